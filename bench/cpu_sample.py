"""CPU seconds of processes by thread name, for what a request costs each of them (bench/gpu.py's (c)), and how
long and how often those threads waited, ready, for a core (the run-queue delay of /proc's schedstat, and the
nonvoluntary context switches): a thread slowed by other processes holding the cores shows there, not in its
CPU time.

The worker names its threads (``broker.common.proc.name_thread``): the IO thread carries the process name, then
``runner-MODEL``, ``complete-MODEL``, and ZeroMQ's ``ZMQbg/IO/0``. Threads of the same name are summed.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import psutil

CpuSample = dict[str, float]  # thread name -> user + system CPU seconds (or another per-thread figure)


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


def run_waits(pid: int) -> CpuSample:
    """Seconds each live thread of ``pid`` has waited on a run queue, by name; empty where the kernel keeps no
    schedstat (or only zeros) or the process is gone."""
    out = _per_thread(pid, lambda tid: int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[1]) / 1e9)
    return out if any(out.values()) else {}


def preemptions(pid: int) -> CpuSample:
    """How often each live thread of ``pid`` was switched out while it could still run (the kernel's
    nonvoluntary context switches), by name; empty once the process is gone."""
    def count(tid: int) -> float:
        for line in Path(f"/proc/{pid}/task/{tid}/status").read_text().splitlines():
            if line.startswith("nonvoluntary_ctxt_switches:"):
                return float(line.split()[1])
        raise ValueError("no nonvoluntary_ctxt_switches")
    return _per_thread(pid, count)


def _per_thread(pid: int, read: Callable[[int], float]) -> CpuSample:
    out: CpuSample = {}
    try:
        tids = [t.id for t in psutil.Process(pid).threads()]
    except psutil.Error:
        return {}
    for tid in tids:
        try:
            name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
            value = read(tid)
        except (OSError, IndexError, ValueError):  # the thread ended, or this kernel keeps no such figure
            continue
        out[name] = out.get(name, 0.0) + value
    return out


def per_request(before: CpuSample, after: CpuSample, requests: int, scale: float = 1e6) -> dict[str, float]:
    """Each thread name's figure per request between two samples, times ``scale`` (1e6: CPU seconds to
    microseconds; 1e3: a count per thousand requests), the largest first, with a total."""
    if requests <= 0:
        return {}
    diff = {k: (after[k] - before.get(k, 0.0)) * scale / requests for k in after}
    out = {k: round(v, 2) for k, v in sorted(diff.items(), key=lambda kv: -kv[1]) if v > 0}
    out["total"] = round(sum(diff.values()), 2)
    return out
