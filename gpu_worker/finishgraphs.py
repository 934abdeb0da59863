"""A photo recipe's ``finish`` step (gpu_worker/devicerecipe.py) for one stream slot as CUDA graphs: one graph a
row bucket (powers of two up to the slot's rows), each reading the slot's static crop buffer and writing the
slot's engine input, so a batch costs the host one graph launch instead of the recipe's several hundred
kernels, which held the worker's runner thread
(bench/RESULTS.md#photos-nvimagecodecs-threads-and-the-finish-step).

A batch of ``n`` rows replays the smallest bucket that holds them: the rows past ``n`` recompute whatever the
buffer held (finite: zeros, or an earlier batch's crops) into engine rows that the batch does not use.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)


def buckets(rows: int) -> list[int]:
    """Powers of two below ``rows``, then ``rows``: [1, 2, 4, ..., rows]."""
    out = []
    b = 1
    while b < rows:
        out.append(b)
        b *= 2
    return [*out, rows]


class FinishGraphs:
    """``crops[:n]`` (float64 [rows, 3, size, size], the slot's static buffer), then ``run(n)``: the recipe's
    ``finish`` of those rows into ``out[:n]`` (float32), queued on the current stream."""

    def __init__(self, torch: Any, recipe: Any, out: Any, rows: int, device: Any) -> None:
        """``out``: the slot's engine input, [max_batch, ...] float32 on ``device``; ``rows`` at most its
        rows. Captures every bucket now (the caller's current stream and device are the slot's)."""
        self.rows = rows
        self.crops = torch.zeros((rows, 3, recipe.size, recipe.size), dtype=torch.float64, device=device)
        self._graphs: dict[int, Any] = {}
        pool = torch.cuda.graph_pool_handle()  # the buckets never run at once: one pool for their temporaries

        def step(b: int) -> None:
            out[:b] = recipe.finish(self.crops[:b]).to(torch.float32)

        for b in reversed(buckets(rows)):  # the largest first: it sizes the shared pool
            step(b)  # outside capture first: the recipe uploads its constants for this size then
            torch.cuda.current_stream(device).synchronize()
            graph = torch.cuda.CUDAGraph()
            # thread_local: the worker's other threads keep querying events and sending while a slot captures
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                step(b)
            self._graphs[b] = graph
        log.debug("finish step captured for %s rows", ", ".join(str(b) for b in sorted(self._graphs)))

    def run(self, n: int) -> None:
        """``finish`` of ``crops[:n]`` into ``out[:n]`` on the current stream.

        Raises:
            ValueError: ``n`` is not from 1 to ``rows`` (the caller runs the recipe itself beyond that).
        """
        b = next((b for b in sorted(self._graphs) if b >= n), None)
        if b is None or n < 1:
            raise ValueError(f"{n} rows: the finish graphs take 1 to {self.rows}")
        self._graphs[b].replay()
