"""A photo recipe's ``finish`` step (gpu_worker/devicerecipe.py) for one stream slot as CUDA graphs: one graph a
row bucket (powers of two up to the slot's rows), each reading the slot's static crop buffer and writing the
slot's engine input, so a batch costs the host one graph launch instead of the recipe's several hundred
kernels, which held the worker's runner thread
(bench/RESULTS.md#photos-nvimagecodecs-threads-and-the-finish-step).

The graphs replay ``FusedFinish``: the recipe compiled by TorchInductor, its elementwise float64 steps fused
into a few kernels. Eager, they read and write the whole batch once per step, and at small photos that GPU
time, not the decoder, set the stage's rate (bench/RESULTS.md#the-photo-stage-on-the-gpu-step-by-step).

A batch of ``n`` rows replays the smallest bucket that holds them: the rows past ``n`` recompute whatever the
buffer held (finite: zeros, or an earlier batch's crops) into engine rows that the batch does not use.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


class FusedFinish:
    """``__call__(crops)``: ``recipe.finish(crops)`` as float32, through ``torch.compile`` (one compile for every
    row count from 2, at the first such call: a lone row runs eager, since PyTorch would compile the whole graph
    again for a size of 1); the eager recipe where the compiler fails, said once in the log. The opennsfw
    preset's rows are the eager ones bit for bit: each step is integer arithmetic, exact in float64, or one
    correctly rounded division (gpu_worker/devicerecipe.py), so fusing changes no value; imagenet's
    normalisation, a multiply and add by inexact constants, may become one fused multiply-add, within a float32
    unit of the last place (tests/gpu/test_finishgraphs.py)."""

    def __init__(self, torch: Any, recipe: Any) -> None:
        self._eager: Callable[[Any], Any] = lambda crops: recipe.finish(crops).to(torch.float32)
        self._compiled: Callable[[Any], Any] | None = None
        self._primed = False
        self._compiled_once = False
        try:  # refused at once where this Python or platform has no compiler support
            self._compiled = torch.compile(self._eager, dynamic=True, fullgraph=True)
        except Exception as exc:  # noqa: BLE001 - as in __call__
            self._eager_from_now(exc)

    @property
    def compiles_next(self) -> bool:
        """Whether the next call of two rows or more compiles (the first such, unless the compiler failed)."""
        return self._compiled is not None and not self._compiled_once

    @property
    def compiled(self) -> bool:
        """Whether calls go through the compiled function (False once it failed)."""
        return self._compiled is not None

    def __call__(self, crops: Any) -> Any:
        if self._compiled is None or crops.shape[0] == 1:
            self._primed = True
            return self._eager(crops)
        if not self._primed:  # the recipe caches its constants at its first call: eager, so none is traced
            self._eager(crops)
            self._primed = True
        try:
            if self._compiled_once:
                return self._compiled(crops)
            return self._first_compiled(self._compiled, crops)
        except Exception as exc:  # noqa: BLE001 - the compiler's errors share no base class but Exception
            self._eager_from_now(exc)
        return self._eager(crops)

    def _first_compiled(self, compiled: Callable[[Any], Any], crops: Any) -> Any:
        """The first compiled call, which compiles: a minute or more with a cold cache, so the log says so."""
        cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or "TorchInductor's default in the temporary directory"
        log.info("compiling the photo recipe's finish step with TorchInductor, once: its cache (%s) keeps the "
                 "kernels for later starts", cache)
        t0 = time.monotonic()
        rows = compiled(crops)
        self._compiled_once = True
        log.info("the photo recipe's finish step compiled in %.1f s", time.monotonic() - t0)
        return rows

    def _eager_from_now(self, exc: Exception) -> None:
        log.warning("the photo recipe's finish step runs eager: torch.compile failed (%s: %s)",
                    type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        self._compiled = None


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

    def __init__(self, torch: Any, recipe: Any, out: Any, rows: int, device: Any,
                 finish: Callable[[Any], Any]) -> None:
        """``out``: the slot's engine input, [max_batch, ...] float32 on ``device``; ``rows`` at most its
        rows; ``finish``: the recipe's crops to float32 rows (``FusedFinish``, shared by a stage's slots).
        Captures every bucket now (the caller's current stream and device are the slot's)."""
        self.rows = rows
        self.crops = torch.zeros((rows, 3, recipe.size, recipe.size), dtype=torch.float64, device=device)
        self._graphs: dict[int, Any] = {}
        pool = torch.cuda.graph_pool_handle()  # the buckets never run at once: one pool for their temporaries

        def step(b: int) -> None:
            out[:b] = finish(self.crops[:b])

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
