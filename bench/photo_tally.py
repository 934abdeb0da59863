"""What one shape of the photo bench's (a) did at one batch size (``Tally``), as figures, and which photos each
batch takes: shared by the host runner's shapes (bench/photo_inprocess.py) and the GPU stage's
(bench/photo_device.py)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from shmbroker.bench.common import Figures


@dataclass
class Tally:
    """What one shape did at one batch size: batches, wall seconds, the seconds each thread spent decoding and in
    the engine (summed over threads), and this process's CPU seconds (the engine's own pool threads included)."""

    runs: int = 0
    seconds: float = 0.0
    decode_s: float = 0.0
    engine_s: float = 0.0
    cpu_s: float = 0.0

    def add(self, other: Tally) -> None:
        self.runs += other.runs
        self.seconds += other.seconds
        self.decode_s += other.decode_s
        self.engine_s += other.engine_s
        self.cpu_s += other.cpu_s


def tally_figures(t: Tally, batch: int, instances: int) -> Figures:
    """A tally as JSON figures: images/s, ms per batch, and per image the decode and engine time of its thread and
    the process's CPU time; ``bound_by`` says which of decode and engine takes longer."""
    images = t.runs * batch
    if not images or t.seconds <= 0:
        return {"runs": t.runs, "seconds": round(t.seconds, 3), "items_per_s": 0.0}
    decode_ms, engine_ms = 1e3 * t.decode_s / images, 1e3 * t.engine_s / images
    return {"runs": t.runs, "seconds": round(t.seconds, 3),
            "ms_per_batch": round(1e3 * t.seconds * instances / t.runs, 2),
            "items_per_s": round(images / t.seconds, 2),
            "decode_ms_per_image": round(decode_ms, 3), "engine_ms_per_image": round(engine_ms, 3),
            "cpu_us_per_image": round(1e6 * t.cpu_s / images, 1),
            "bound_by": "decode" if decode_ms > engine_ms else "engine"}


def batches(images: int, batch: int, thread: int, instances: int) -> list[list[int]]:
    """The photo indices of each batch a thread takes in one pass: the threads start at evenly spaced photos, so
    that instances running at once decode different ones; every batch has ``batch`` indices, wrapping around."""
    start = thread * images // max(1, instances)
    count = max(1, images // batch) if images >= batch else 1
    return [[(start + k * batch + j) % images for j in range(batch)] for k in range(count)]


def on_threads(body: Callable[[int], None], tallies: list[Tally], name: str) -> Tally:
    """``body(i)`` on one thread each for ``tallies`` (the first the caller's), each adding to ``tallies[i]``:
    their sum, with the wall and CPU time of the whole; the first failure is raised once every thread ended."""
    failures: list[BaseException] = []

    def run(i: int) -> None:
        try:
            body(i)
        except BaseException as exc:  # noqa: BLE001 - raised again below, on the caller's thread
            failures.append(exc)

    t0, cpu0 = time.perf_counter(), time.process_time()
    threads = [threading.Thread(target=run, args=(i,), name=f"{name}-{i}") for i in range(1, len(tallies))]
    for thread in threads:
        thread.start()
    run(0)
    for thread in threads:
        thread.join()
    if failures:
        raise failures[0]
    out = Tally(seconds=time.perf_counter() - t0, cpu_s=time.process_time() - cpu0)
    for t in tallies:
        out.add(Tally(t.runs, 0.0, t.decode_s, t.engine_s))
    return out
