"""The concurrency sweep of ``shmbroker bench --plot``: throughput and per-request latency at each in-flight count.

One *point* is one window of the throughput machinery (``Client.call`` chains in spawned processes, an
uncounted warm-up, then a fixed window, then a drain) at a given total number of requests in flight, with
per-request timing switched on: every process times each of its requests from just before ``Client.call``
to its callback, and the point's p50/p99 are taken over the requests of all processes that completed
inside the window. Throughput is counted exactly as in the throughput phases. The total in flight is
spread over at most ``MAX_PROCESSES`` processes (1, 2 and 4 in flight: one request per process), so that
the low end measures the broker, not one client's queueing.

One set of processes runs all of a model's points as rounds (``bench.load.sweep_client``): spawning and
warming up processes per point cost 3 to 6 s each on the 2-core machine, more than the windows. Each
round starts on a barrier shared by the processes and the bench, once every process has drained the round
before, and the bench takes the worker's counters there, so each point has its own mean batch size.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from shmbroker.bench import load
from shmbroker.bench.broker_proc import counters_delta, model_counters
from shmbroker.bench.common import BenchError, Figures, Progress, latency_summary
from shmbroker.bench.procs import run_group, spawn_context
from shmbroker.broker.common import protocol as P

MAX_PROCESSES = 4
ROUND_TIMEOUT_S = 300.0  # one barrier wait: set-up before the first round, a window and its drain after
Stats = Callable[[], P.StatsReply | None]


@dataclass(frozen=True)
class Plan:
    """What one model's sweep runs: the totals in flight, in order, and its warm-ups."""

    model: str
    concurrencies: tuple[int, ...]
    warmup_s: float  # uncounted, after the barrier: long enough for the deepest queue to fill
    warmup_requests: int  # per process, before the barrier (sequential infer calls)
    window_scale: float = 1.0  # times the sweep's window: a slow model needs longer to count enough requests


# nsfw runs 20 to 50 images/s on the reference machine: a window twice as long counts enough of them for a
# p99, and it stops at 32 in flight, because 64 is only a longer queue (latency ~1.3 s) at the same rate
PLANS = (
    Plan("tiny", (1, 2, 4, 8, 16, 32, 64), warmup_s=0.5, warmup_requests=50),
    Plan("nsfw", (1, 2, 4, 8, 16, 32), warmup_s=1.0, warmup_requests=2, window_scale=2.0),
)

MODELS = tuple(plan.model for plan in PLANS)


def split(concurrency: int, max_processes: int = MAX_PROCESSES) -> list[int]:
    """Requests in flight per process: ``concurrency`` over ``min(concurrency, max_processes)`` processes,
    as even as possible (the first processes take the remainder). Raises ValueError below 1."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    n = min(concurrency, max_processes)
    return [concurrency // n + (1 if i < concurrency % n else 0) for i in range(n)]


def _merge(concurrency: int, in_flight: list[int], window_s: float, parts: list[Figures]) -> Figures:
    """One point from the window figures of the processes that took part in its round."""
    samples = np.concatenate([r["latency_ns"] for r in parts])
    codes: dict[str, int] = {}
    for r in parts:
        for code, n in (r.get("error_codes") or {}).items():
            codes[code] = codes.get(code, 0) + n
    lost = sum(r.get("lost", 0) for r in parts)
    completed = sum(r["completed"] for r in parts)
    return {
        "concurrency": concurrency,
        "processes": len(in_flight),
        "in_flight_per_process": in_flight,
        "window_s": window_s,
        "completed": completed,
        "errors": sum(r["errors"] for r in parts),
        "per_s": round(completed / window_s, 1),
        "latency": latency_summary(samples),
        **({"error_codes": codes} if codes else {}),
        **({"lost": lost} if lost else {}),
    }


def _watch(barrier: threading.Barrier, plan: Plan, stats: Stats | None, snaps: list[dict[str, Any]],
           progress: Progress) -> None:
    """The bench's seat at the round barrier: a server-counter snapshot as each round starts and at the end."""
    n = len(plan.concurrencies)
    for k in range(n + 1):
        try:
            barrier.wait(ROUND_TIMEOUT_S)
        except threading.BrokenBarrierError:  # a child failed or the sweep is over: run_group reports it
            return
        snaps.append(model_counters(stats()) if stats is not None else {})
        if k < n:
            progress.note(f"point {k + 1}/{n}: {plan.concurrencies[k]} in flight")


def sweep(progress: Progress, runtime_dir: str, plan: Plan, window_s: float, stats: Stats | None = None) -> Figures:
    """Every point of ``plan``, in order, by one set of client processes: {model, window_s, warmup_s, points}.

    Each point's window is ``window_s * plan.window_scale``.

    A point has concurrency, processes, in_flight_per_process, window_s, completed, errors, per_s, latency
    (``latency_summary`` over the in-window successful requests), error_codes and lost when non-zero, and,
    with ``stats``, the worker's server_* counters over its round (warm-up and drain included). Raises
    BenchError when a client process fails or a point has no request inside its window.
    """
    window_s *= plan.window_scale
    splits = [split(c) for c in plan.concurrencies]
    nproc = max(len(s) for s in splits)
    barrier = spawn_context().Barrier(nproc + 1)
    specs = [{"runtime_dir": runtime_dir, "model": plan.model, "rows": 1, "index": i, "seed": 2000 + i,
              "rounds": [s[i] if i < len(s) else 0 for s in splits], "round_barrier": barrier,
              "round_timeout_s": ROUND_TIMEOUT_S, "warmup_requests": plan.warmup_requests,
              "warmup_s": plan.warmup_s, "duration_s": window_s} for i in range(nproc)]
    snaps: list[dict[str, Any]] = []
    watcher = threading.Thread(target=_watch, args=(barrier, plan, stats, snaps, progress), daemon=True)
    watcher.start()
    try:
        results = run_group(progress, load.sweep_client, specs, expect_s=len(splits) * (plan.warmup_s + window_s))
    finally:
        barrier.abort()  # frees the watcher if a child never came
        watcher.join(5.0)
    points: list[Figures] = []
    for k, (c, in_flight) in enumerate(zip(plan.concurrencies, splits, strict=True)):
        f = _merge(c, in_flight, window_s, [r["rounds"][k] for r in results if r["rounds"][k] is not None])
        if len(snaps) > k + 1:
            f.update(counters_delta(snaps[k], snaps[k + 1], plan.model))
        lat = f["latency"]
        if not lat.get("samples"):
            raise BenchError(f"{plan.model} at {c} in flight: no request completed inside the {window_s:g} s window")
        progress.note(f"{c:>3} in flight ({f['processes']} procs): {f['per_s']:,.1f}/s, p50 {lat['p50_us']:,.0f} us, "
                      f"p99 {lat['p99_us']:,.0f} us, {f['errors']} errors")
        points.append(f)
    return {"model": plan.model, "window_s": window_s, "warmup_s": plan.warmup_s, "points": points}


def summary(f: Figures) -> str:
    """The phase's one-line result: the best throughput and the latency at it."""
    best = max(f["points"], key=lambda p: p["per_s"])
    return (f"{len(f['points'])} points; best {best['per_s']:,.1f}/s at {best['concurrency']} in flight "
            f"(p50 {best['latency']['p50_us']:,.0f} us, p99 {best['latency']['p99_us']:,.0f} us)")


def table(measurements: dict[str, Figures], models: Sequence[str] = MODELS) -> str:
    """The human table of every sweep in ``measurements`` (keys ``<model>_sweep``); empty when there is none."""
    lines: list[str] = []
    for model in models:
        f = measurements.get(f"{model}_sweep")
        if not isinstance(f, dict):
            continue
        lines += ["", f"concurrency sweep: {model}"
                  + (f" FAILED: {str(f['error']).splitlines()[0][:80]}" if "error" in f else
                     f" ({f['window_s']:g} s windows after {f['warmup_s']:g} s warm-up)")]
        if "error" in f:
            continue
        lines += [f"{'in flight':>9} {'procs':>5} {'per s':>11} {'p50 us':>10} {'p99 us':>10} {'mean batch':>10} "
                  f"{'errors':>7}", "-" * 70]
        for p in f["points"]:
            batch = p.get("server_mean_batch")
            lines.append(f"{p['concurrency']:>9} {p['processes']:>5} {p['per_s']:>11,.1f} "
                         f"{p['latency']['p50_us']:>10,.0f} {p['latency']['p99_us']:>10,.0f} "
                         f"{'-' if batch is None else format(batch, '.2f'):>10} {p['errors']:>7,}")
    return "\n".join(lines) + ("\n" if lines else "")
