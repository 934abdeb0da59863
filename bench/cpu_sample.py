"""CPU seconds of processes by thread name, for what a request costs each of them (bench/gpu.py's (c)).

The worker names its threads (``broker.common.proc.name_thread``): the IO thread carries the process name, then
``runner-MODEL``, ``complete-MODEL``, and ZeroMQ's ``ZMQbg/IO/0``. Threads of the same name are summed.
"""

from __future__ import annotations

from pathlib import Path

import psutil

CpuSample = dict[str, float]  # thread name -> user + system CPU seconds


def threads(pid: int) -> CpuSample:
    """CPU seconds of each live thread of ``pid`` by name; empty once the process is gone."""
    out: CpuSample = {}
    try:
        for t in psutil.Process(pid).threads():
            try:
                name = Path(f"/proc/{pid}/task/{t.id}/comm").read_text().strip()
            except OSError:  # the thread ended between the two reads
                continue
            out[name] = out.get(name, 0.0) + t.user_time + t.system_time
    except psutil.Error:
        return {}
    return out


def per_request_us(before: CpuSample, after: CpuSample, requests: int) -> dict[str, float]:
    """CPU microseconds per request of each thread name between two samples, the busiest first, with a total."""
    if requests <= 0:
        return {}
    diff = {k: (after[k] - before.get(k, 0.0)) * 1e6 / requests for k in after}
    out = {k: round(v, 2) for k, v in sorted(diff.items(), key=lambda kv: -kv[1]) if v > 0}
    out["total"] = round(sum(diff.values()), 2)
    return out
