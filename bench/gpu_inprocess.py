"""In the bench process, no broker: (a) the engine's limit and the copy-call measurement.

(a) The model's own engine (``load_engine`` with the config's engine, fp16 and cuda_graphs) and one stream
slot's context, as the worker builds them; ``enqueue(b)`` back to back on one stream, timed by CUDA events,
at each batch size from 1 up to the sweep's end (powers of two, 256 by default, whatever the config's
max_batch, and max_batch itself; an inductor package's own buckets up to its largest). Inputs stay on the
device: this is what the GPU can do with the model, with no copies at all. The best images/s over the sweep is
the limit; the time of one max batch is the compute term of the p99 target. Then one batch-1 request at a
time with its copies from page-locked memory and a wait for its end: the yardstick of a lone request.

Copies: what one batch's gather costs, one ``cudaMemcpyAsync`` per request or one ``cudaMemcpyBatchAsync``
per batch, from a registered ring segment into a device buffer (inputs), and back (outputs), timed on the
host (the issuing thread's cost, which the pipeline pays under the GIL) and on the device (events).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from shmbroker.bench import gpu_datapath
from shmbroker.bench.common import Figures, Progress
from shmbroker.broker.common.config import Config
from shmbroker.broker.common.ring import RingLayout
from shmbroker.gpu_worker import cuda, model_source
from shmbroker.gpu_worker.engines import load_engine
from shmbroker.gpu_worker.engines.base import DeviceContext, DeviceEngine

COPY_COUNTS = (1, 8, 32)
COPY_REPS = 50
LONE_RUNS = 300
LONE_WARMUP = 20


def batch_sizes(max_batch: int) -> list[int]:
    return sorted({1 << k for k in range(max_batch.bit_length()) if 1 << k <= max_batch} | {max_batch})


def load_device_engine(cfg: Config, model: str, device: int) -> DeviceEngine:
    mc = cfg.models[model]
    engine = load_engine(mc.engine, model_source.resolve(cfg.model_path(model)), device=str(device), model=mc)
    if not callable(getattr(engine, "create_context", None)):
        raise RuntimeError(f"model {model!r}: engine {mc.engine!r} is not a GPU engine")
    return engine  # type: ignore[return-value]


def limit(cfg: Config, model: str, device: int, duration_s: float, progress: Progress, sweep_max: int = 256) -> Figures:
    """(a): back-to-back enqueues per batch size on one stream, about ``duration_s`` in all."""
    mc = cfg.models[model]
    cuda.set_device(device)
    t_load = time.monotonic()
    engine = load_device_engine(cfg, model, device)
    load_s = time.monotonic() - t_load
    largest = int(getattr(engine, "largest", max(sweep_max, mc.max_batch)))  # an inductor package's last bucket
    wanted = [b for b in [*batch_sizes(sweep_max), mc.max_batch] if b <= largest]
    stream = cuda.Stream()
    ctx = engine.create_context(0, stream.handle, max(wanted), sizes=wanted)
    sizes = list(getattr(ctx, "sizes", sorted(set(wanted))))  # the buckets themselves, where the engine pads
    graph_sizes = list(getattr(ctx, "graph_sizes", []))
    context_s = time.monotonic() - t_load - load_s
    progress.note(f"engine loaded in {load_s:.1f} s, one context ready in {context_s:.1f} s")
    start, end = cuda.Event(timing=True), cuda.Event(timing=True)
    by_batch: dict[str, Figures] = {}
    try:
        for b in sizes:
            one = back_to_back_ms(ctx, stream, start, end, b, 5) / 5  # warm, and how many fit the time share
            n = max(20, int(duration_s / len(sizes) * 1e3 / max(one, 1e-3)))
            ms = back_to_back_ms(ctx, stream, start, end, b, n)
            by_batch[str(b)] = {"runs": n, "ms_per_batch": round(ms / n, 4),
                                "items_per_s": round(n * b / (ms / 1e3), 1)}
            progress.tick(f"batch {b}: {ms / n:.3f} ms, {n * b / (ms / 1e3):,.0f} images/s")
        lone = lone_request(engine, ctx, stream, end)
        progress.tick(f"one request at a time, copies included: p50 {lone['p50_ms']:.3f} ms")
        ctx.close()
        stream.close()
        best = max(by_batch, key=lambda k: by_batch[k]["items_per_s"])
        served = min(b for b in sizes if b >= mc.max_batch)  # the batch that a max_batch request runs as
        max_ms = by_batch[str(served)]["ms_per_batch"]
        try:
            concurrent = _concurrent(engine, mc.streams, mc.max_batch, max_ms, duration_s / 2)
            progress.tick(f"{mc.streams} streams at batch {mc.max_batch}: {concurrent['items_per_s']:,.0f} images/s")
        except (RuntimeError, ValueError) as exc:  # an information figure: its failure is reported, not fatal
            concurrent = {"error": f"{type(exc).__name__}: {exc}"}
        try:
            datapath = gpu_datapath.with_copies(engine, mc.streams, mc.max_batch, duration_s / 2)
            progress.tick(f"{mc.streams} stream slots at batch {mc.max_batch} with their copies: "
                          f"{datapath['items_per_s']:,.0f} images/s")
        except (RuntimeError, ValueError) as exc:  # an information figure, as above
            datapath = {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        ctx.close()
        stream.close()
        engine.close()
    return {
        "model": model, "engine": mc.engine, "fp16": mc.fp16 or getattr(engine, "precision", "") == "fp16",
        "cuda_graphs": mc.cuda_graphs,
        "graph_sizes": graph_sizes, "load_s": round(load_s, 2), "context_s": round(context_s, 2),
        "by_batch": by_batch, "best_batch": int(best), "items_per_s": by_batch[best]["items_per_s"],
        "max_batch": mc.max_batch, "max_batch_ms": max_ms, "concurrent_streams": concurrent,
        "with_copies": datapath, "lone": lone,
    }


def back_to_back_ms(ctx: DeviceContext, stream: cuda.Stream, start: cuda.Event, end: cuda.Event, batch: int,
                    n: int) -> float:
    """Device milliseconds of ``n`` batches of ``batch`` rows enqueued back to back on ``stream``."""
    start.record(stream)
    for _ in range(n):
        ctx.enqueue(batch)
    end.record(stream)
    end.synchronize()
    return float(cuda.elapsed_ms(start, end))


def lone_request(engine: DeviceEngine, ctx: DeviceContext, stream: cuda.Stream, end: cuda.Event,
                 runs: int = LONE_RUNS) -> Figures:
    """One batch-1 request at a time, as an application holding the engine would run it: H2D of its inputs
    from page-locked memory, ``enqueue(1)``, D2H of its outputs, wait for the end; wall-clock per request.
    The yardstick of a lone request through the broker (which adds the rings, sockets and threads)."""
    ins = [cuda.host_alloc_pinned(s.item_bytes) for s in engine.inputs]
    outs = [cuda.host_alloc_pinned(s.item_bytes) for s in engine.outputs]
    h = stream.handle
    try:
        times = []
        for i in range(runs + LONE_WARMUP):
            t0 = time.perf_counter()
            for src, dst, s in zip(ins, ctx.input_ptrs, engine.inputs, strict=True):
                cuda.memcpy_async(dst, src, s.item_bytes, "h2d", h)
            ctx.enqueue(1)
            for dst, src, s in zip(outs, ctx.output_ptrs, engine.outputs, strict=True):
                cuda.memcpy_async(dst, src, s.item_bytes, "d2h", h)
            end.record(stream)
            end.synchronize()
            if i >= LONE_WARMUP:
                times.append((time.perf_counter() - t0) * 1e3)
    finally:
        for ptr in ins + outs:
            cuda.free_host(ptr)
    times.sort()
    return {"runs": runs, "p50_ms": round(statistics.median(times), 4), "p99_ms": round(times[int(0.99 * runs)], 4)}


def _concurrent(engine: DeviceEngine, streams: int, max_batch: int, single_ms: float, duration_s: float) -> Figures:
    """Information: ``streams`` contexts on their own streams, max batches enqueued round-robin, wall-clock
    timed from the first launch to the last stream's end (what concurrent graph replays add over one stream)."""
    pairs = []
    try:
        for i in range(streams):
            st = cuda.Stream()
            pairs.append((st, engine.create_context(i, st.handle, max_batch)))
        for st, c in pairs:
            c.enqueue(max_batch)
            st.synchronize()
        rounds = max(10, int(duration_s * 1e3 / max(single_ms, 1e-3) / streams))
        t0 = time.perf_counter()
        for _ in range(rounds):
            for _st, c in pairs:
                c.enqueue(max_batch)
        for st, _c in pairs:
            st.synchronize()
        wall = time.perf_counter() - t0
    finally:
        for st, c in pairs:
            c.close()
            st.close()
    return {"streams": streams, "batch": max_batch, "rounds": rounds, "seconds": round(wall, 3),
            "items_per_s": round(rounds * streams * max_batch / wall, 1)}


def _timed(issue: Callable[[], None], stream: cuda.Stream, start: cuda.Event, end: cuda.Event) -> tuple[float, float]:
    """(host microseconds to issue, device microseconds to complete) of one round of copies."""
    start.record(stream)
    t0 = time.perf_counter()
    issue()
    host = (time.perf_counter() - t0) * 1e6
    end.record(stream)
    end.synchronize()
    return host, cuda.elapsed_ms(start, end) * 1e3


def copies(device: int, in_bytes: int, out_bytes: int) -> Figures:
    """Per-call against batched copies for COPY_COUNTS requests of ``in_bytes`` in and ``out_bytes`` out."""
    cuda.set_device(device)
    n_max = max(COPY_COUNTS)
    layout = RingLayout(1, n_max, in_bytes, max(out_bytes, 64))
    stream = cuda.Stream()
    start, end = cuda.Event(timing=True), cuda.Event(timing=True)
    out: Figures = {"in_bytes": in_bytes, "out_bytes": out_bytes, "reps": COPY_REPS,
                    "batch_call_available": cuda.has_memcpy_batch()}
    try:
        with gpu_datapath.registered_ring(layout) as seg, cuda.DeviceBuffer(n_max * in_bytes) as dev_in, \
                cuda.DeviceBuffer(n_max * max(out_bytes, 64)) as dev_out:
            try:
                for n in COPY_COUNTS:
                    h2d = ([dev_in.ptr + i * in_bytes for i in range(n)],
                           [seg.address + layout.input_bases[i] for i in range(n)], [in_bytes] * n, "h2d")
                    d2h = ([seg.address + layout.output_bases[i] for i in range(n)],
                           [dev_out.ptr + i * out_bytes for i in range(n)], [out_bytes] * n, "d2h")
                    for name, (dsts, srcs, sizes, kind) in (("h2d", h2d), ("d2h", d2h)):
                        out[f"{name}_x{n}"] = _compare(dsts, srcs, sizes, kind, stream, start, end)
            finally:
                stream.synchronize()  # before the buffers and the ring's registration go
    finally:
        stream.close()
    return out


def _compare(dsts: list[int], srcs: list[int], sizes: list[int], kind: str, stream: cuda.Stream,
             start: cuda.Event, end: cuda.Event) -> Figures:
    h = stream.handle

    def per_call() -> None:
        for d, s, n in zip(dsts, srcs, sizes, strict=True):
            cuda.memcpy_async(d, s, n, kind, h)

    def batched() -> None:
        cuda.memcpy_batch_async(dsts, srcs, sizes, h)

    res: Figures = {}
    for name, fn in (("per_call", per_call), ("batched", batched)):
        try:
            runs = [_timed(fn, stream, start, end) for _ in range(COPY_REPS)]
        except cuda.CudaError as exc:
            res[name] = {"error": str(exc)}
            continue
        res[name] = {"host_us": round(statistics.median(r[0] for r in runs), 1),
                     "device_us": round(statistics.median(r[1] for r in runs), 1)}
    return res
