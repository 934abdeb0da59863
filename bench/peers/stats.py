"""The figures of one measurement, from its client processes' parts and the sampler's readings (pure; no IO).

Each client process reports its window on the system-wide monotonic clock, its answered requests' latencies
and its own CPU seconds over the window. The sampler reads the server's processes' CPU seconds and the GPU's
utilization every few tenths of a second; a window's server CPU is the difference of the readings interpolated at
the window's ends, and its GPU busy the mean of the readings inside it.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

import numpy as np

from shmbroker.bench.common import latency_summary
from shmbroker.bench.peers.answers import Tally

Figures = dict[str, Any]
Reading = tuple[float, float]  # (monotonic seconds, value)


def common_window(parts: Sequence[Figures]) -> tuple[float, float]:
    """The span every process counted in: the latest start to the earliest end."""
    return max(p["window_monotonic"][0] for p in parts), min(p["window_monotonic"][1] for p in parts)


def at(readings: Sequence[Reading], t: float) -> float | None:
    """A cumulative reading (CPU seconds) at ``t``, interpolated between the readings around it; None outside."""
    times = [r[0] for r in readings]
    k = bisect.bisect_left(times, t)
    if k < len(times) and times[k] == t:
        return readings[k][1]
    if k == 0 or k == len(times):
        return None
    (t0, v0), (t1, v1) = readings[k - 1], readings[k]
    return v0 + (v1 - v0) * (t - t0) / (t1 - t0)


def delta(readings: Sequence[Reading], t0: float, t1: float) -> float | None:
    """How much a cumulative reading grew over [t0, t1]; None when the readings do not cover it."""
    a, b = at(readings, t0), at(readings, t1)
    return None if a is None or b is None else b - a


def mean_inside(readings: Sequence[Reading], t0: float, t1: float) -> float | None:
    """The mean of the readings taken inside [t0, t1] (GPU utilization); None when none was."""
    inside = [v for t, v in readings if t0 <= t <= t1]
    return round(sum(inside) / len(inside), 1) if inside else None


def merge(parts: Sequence[Figures], concurrency: int, cpu: Sequence[Reading] | None = None,
          gpu: Sequence[Reading] | None = None) -> Figures:
    """One measurement from its processes' parts: answers/s over the window, latency percentiles over every
    process's window samples, the answers' tally, and CPU microseconds per answer (server, clients, host)."""
    window_s = float(parts[0]["window_s"])
    completed = sum(int(p["completed"]) for p in parts)
    errors = sum(int(p["errors"]) for p in parts)
    codes: dict[str, int] = {}
    tally = Tally()
    for p in parts:
        for code, n in p.get("error_codes", {}).items():
            codes[code] = codes.get(code, 0) + int(n)
        tally.add(Tally.from_dict(p["answers"]))
    samples = np.concatenate([np.asarray(p["latency_ns"], dtype=np.int64) for p in parts])
    per_s = completed / window_s if window_s > 0 else 0.0
    t0, t1 = common_window(parts)
    client_rate = sum(float(p["cpu_s"]) for p in parts) / window_s if window_s > 0 else 0.0
    server_cpu_s = delta(cpu, t0, t1) if cpu and t1 > t0 else None
    server_rate = None if server_cpu_s is None else server_cpu_s / (t1 - t0)
    out: Figures = {
        "concurrency": concurrency, "processes": len(parts), "in_flight_per_process": [p["in_flight"] for p in parts],
        "window_s": window_s, "completed": completed, "errors": errors, "error_codes": codes,
        "per_s": round(per_s, 1), "latency": latency_summary(samples), "answers": tally.as_dict(),
        "cpu_us_per_request": cpu_per_request(server_rate, client_rate, per_s),
        "gpu_busy_pct": mean_inside(gpu, t0, t1) if gpu else None,
    }
    return out


def cpu_per_request(server_rate: float | None, client_rate: float, per_s: float) -> Figures:
    """CPU microseconds per answered request from CPU seconds per second of the server's processes and of the
    clients' (their sum: the host's), at ``per_s`` answers a second."""
    if per_s <= 0:
        return {"server": None, "clients": None, "host": None}
    server = None if server_rate is None else round(server_rate * 1e6 / per_s, 1)
    clients = round(client_rate * 1e6 / per_s, 1)
    return {"server": server, "clients": clients, "host": None if server is None else round(server + clients, 1)}


def best(points: Sequence[Figures]) -> Figures:
    """The saturation point: the most answers/s among the points measured at several depths."""
    if not points:
        raise ValueError("no points to choose from")
    return max(points, key=lambda p: p["per_s"])
