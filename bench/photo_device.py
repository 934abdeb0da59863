"""(a) of the photo bench on a GPU worker: the in-process limit of the device photo stage + engine, no broker.

The model's runner as the worker builds it (``gpu_worker.models.photo_runner``: a ``DevicePhotoRunner``, its
stage and its stream slots), warmed up as the worker warms it. One thread takes the slots in turn, as the
worker's runner thread does: it waits for a slot's previous batch, decodes and preprocesses a batch of encoded
photos into the slot's engine input (``DevicePhotos.run_rows``, the stage a request's rows take), and launches
the engine on it, so one slot's decode overlaps the other slots' computes. The second shape gives each slot a
thread of its own, so that one slot's Python runs while another's decoder waits for the JPEG engines: the sweep
keeps whichever is faster as the limit. CUDA events on each slot's stream time the stage and the engine on the
device, so the figures say which of the two sets the limit.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from shmbroker.bench.common import BenchError
from shmbroker.bench.photo_tally import Tally, batches, on_threads
from shmbroker.gpu_worker import cuda
from shmbroker.gpu_worker.devicephotos import DevicePhotoRunner
from shmbroker.gpu_worker.streams import StreamSlot


@dataclass
class DeviceShape:
    """The GPU worker's photo runner: ``instances`` is 1 (the slots overlap on the device), issued by one thread,
    or with ``slot_threads`` by a thread per slot (``owner`` False: a second view of a runner another shape owns
    and closes)."""

    runner: DevicePhotoRunner
    instances: int = 1
    threads: int = 0
    slot_threads: bool = False
    owner: bool = True
    what = ("gpu_worker.devicephotos.DevicePhotoRunner (DevicePhotos.run_rows on each stream slot in turn, then "
            "the engine)")

    @property
    def name(self) -> str:
        return f"{len(self.runner.slots)} stream slots" + (", a thread each" if self.slot_threads else "")

    @property
    def decoder(self) -> str:
        return self.runner.stage.backend

    def window(self, images: Sequence[memoryview], b: int, seconds: float, min_runs: int) -> Tally:
        """Batches of ``b`` back to back over the slots for ``seconds`` (at least ``min_runs`` in all);
        ``decode_s`` and ``engine_s`` are the device's time in the stage and in the engine (events), summed over
        batches."""
        slots = self.runner.slots
        groups = [[s] for s in slots] if self.slot_threads else [list(slots)]
        tallies = [Tally() for _ in groups]
        launched = itertools.count(1)  # batches launched by every thread; next() is atomic under the GIL
        t0 = time.perf_counter()

        def done() -> bool:
            return next(launched) >= min_runs and time.perf_counter() - t0 >= seconds

        return on_threads(lambda g: self._issue(groups[g], images, batches(len(images), b, g, len(groups)),
                                                tallies[g], done), tallies, "bench-slot")

    def _issue(self, slots: list[StreamSlot], images: Sequence[memoryview], plan: list[list[int]],
               tally: Tally, done: Callable[[], bool]) -> None:
        """One issuing thread: batches of ``plan`` into ``slots`` in turn, each slot's previous batch waited for
        first, until ``done`` (asked once a batch is launched); then every slot's last batch collected."""
        stage = self.runner.stage
        pending = [False] * len(slots)  # a slot's batch launched and not yet collected
        k = 0
        while True:
            i = k % len(slots)
            slot = slots[i]
            if pending[i]:
                self._collect(slot, tally)
            slot.start.record(slot.stream)
            n, bad = stage.run_rows([images[j] for j in plan[k % len(plan)]], slot)
            if bad:
                raise BenchError(f"a photo of the set does not decode: {next(iter(bad.values()))}")
            slot.copied_in.record(slot.stream)
            slot.ctx.enqueue(n)
            slot.computed.record(slot.stream)
            pending[i] = True
            k += 1
            if done():
                break
        for i, slot in enumerate(slots):
            if pending[i]:
                self._collect(slot, tally)

    @staticmethod
    def _collect(slot: StreamSlot, tally: Tally) -> None:
        """Wait for the slot's batch and add its device times."""
        slot.computed.synchronize()
        tally.runs += 1
        tally.decode_s += cuda.elapsed_ms(slot.start, slot.copied_in) / 1e3
        tally.engine_s += cuda.elapsed_ms(slot.copied_in, slot.computed) / 1e3

    def close(self) -> None:
        if self.owner:
            self.runner.stop()
            self.runner.engine.close()


def device_shape(runner: Any) -> DeviceShape:
    """The worker's device photo runner, warmed up, as a shape of the sweep; BenchError if it is not one."""
    if not isinstance(runner, DevicePhotoRunner):
        raise BenchError(f"the worker's runner is a {type(runner).__name__}, not a DevicePhotoRunner")
    runner.warm_up()
    return DeviceShape(runner)
