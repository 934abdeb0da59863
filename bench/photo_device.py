"""(a) of the photo bench on a GPU worker: the in-process limit of the device photo stage + engine, no broker.

The model's runner as the worker builds it (``gpu_worker.models.photo_runner``: a ``DevicePhotoRunner``, its
stage and its stream slots), warmed up as the worker warms it. One thread takes the slots in turn, as the
worker's runner thread does: it waits for a slot's previous batch, decodes and preprocesses a batch of encoded
photos into the slot's engine input (``DevicePhotos.run_rows``, the stage a request's rows take), and launches
the engine on it, so one slot's decode overlaps the other slots' computes. CUDA events on each slot's stream
time the stage and the engine on the device, so the figures say which of the two sets the limit.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from shmbroker.bench.common import BenchError
from shmbroker.bench.photo_tally import Tally, batches
from shmbroker.gpu_worker import cuda
from shmbroker.gpu_worker.devicephotos import DevicePhotoRunner
from shmbroker.gpu_worker.streams import StreamSlot


@dataclass
class DeviceShape:
    """The GPU worker's photo runner: ``instances`` is 1 (one thread issues, the slots overlap on the device)."""

    runner: DevicePhotoRunner
    instances: int = 1
    threads: int = 0
    what = ("gpu_worker.devicephotos.DevicePhotoRunner (DevicePhotos.run_rows on each stream slot in turn, then "
            "the engine)")

    @property
    def name(self) -> str:
        return f"{len(self.runner.slots)} stream slots"

    @property
    def decoder(self) -> str:
        return self.runner.stage.backend

    def window(self, images: Sequence[memoryview], b: int, seconds: float, min_runs: int) -> Tally:
        """Batches of ``b`` back to back over the slots for ``seconds`` (at least ``min_runs``); ``decode_s`` and
        ``engine_s`` are the device's time in the stage and in the engine (events), summed over batches."""
        slots, stage = self.runner.slots, self.runner.stage
        tally = Tally()
        pending = [False] * len(slots)  # a slot's batch launched and not yet collected
        plan = batches(len(images), b, 0, 1)
        t0, cpu0 = time.perf_counter(), time.process_time()
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
            if time.perf_counter() - t0 >= seconds and k >= min_runs:
                break
        for i, slot in enumerate(slots):
            if pending[i]:
                self._collect(slot, tally)
        tally.seconds = time.perf_counter() - t0
        tally.cpu_s = time.process_time() - cpu0
        return tally

    @staticmethod
    def _collect(slot: StreamSlot, tally: Tally) -> None:
        """Wait for the slot's batch and add its device times."""
        slot.computed.synchronize()
        tally.runs += 1
        tally.decode_s += cuda.elapsed_ms(slot.start, slot.copied_in) / 1e3
        tally.engine_s += cuda.elapsed_ms(slot.copied_in, slot.computed) / 1e3

    def close(self) -> None:
        self.runner.stop()
        self.runner.engine.close()


def device_shape(runner: Any) -> DeviceShape:
    """The worker's device photo runner, warmed up, as a shape of the sweep; BenchError if it is not one."""
    if not isinstance(runner, DevicePhotoRunner):
        raise BenchError(f"the worker's runner is a {type(runner).__name__}, not a DevicePhotoRunner")
    runner.warm_up()
    return DeviceShape(runner)
