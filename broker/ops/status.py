"""``shmbroker status``: workers, models, queue depths, throughput, latency percentiles and GPU use.

A snapshot asks the broker for STATS twice, ``interval`` seconds apart (over the control socket, like
``shmbroker stats``), and reports rates and latency percentiles over that interval. ``--json`` prints one
snapshot; otherwise a rich live view refreshes once per interval until Ctrl-C.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from shmbroker.broker.common import protocol as P
from shmbroker.broker.common.ask import ask_broker
from shmbroker.broker.ops.gpu_info import gpu_samples

ASK_TIMEOUT_S = 5.0
QUANTILES = (0.5, 0.9, 0.99)


class StatusError(RuntimeError):
    """No broker answered; the message says where it looked."""


@dataclass
class Sample:
    at: float
    stats: P.StatsReply
    cpu: dict[int, float] = field(default_factory=dict)  # pid -> user + system seconds


def sample(runtime_dir: Path) -> Sample:
    reply = ask_broker(runtime_dir, P.StatsRequest(), ASK_TIMEOUT_S)
    if not isinstance(reply, P.StatsReply):
        raise StatusError(f"no broker answered on {runtime_dir} (is `shmbroker serve` running?)")
    cpu = {}
    for w in reply.workers:
        try:
            t = psutil.Process(w.pid).cpu_times()
            cpu[w.pid] = t.user + t.system
        except psutil.Error:
            continue  # gone since it answered: its row shows no CPU figure
    return Sample(time.monotonic(), reply, cpu)


def snapshot(runtime_dir: Path, interval: float = 1.0, first: Sample | None = None) -> dict[str, Any]:
    """One JSON-ready snapshot; ``first`` (the previous refresh's sample) spares the wait of ``interval``."""
    a = first or sample(runtime_dir)
    if first is None:
        time.sleep(interval)  # the measuring interval of the rates, not a wait for readiness
    b = sample(runtime_dir)
    health = ask_broker(runtime_dir, P.Health(0), ASK_TIMEOUT_S)
    dt = max(b.at - a.at, 1e-6)
    before = {w.worker_id: w for w in a.stats.workers}
    out: dict[str, Any] = {"interval_s": round(dt, 3), "ready": isinstance(health, P.HealthReply) and health.ready,
                           "workers": [], "models": {}, "gpus": []}
    for w in b.stats.workers:
        old = before.get(w.worker_id)
        same = old is not None and old.pid == w.pid  # a restarted worker's counters start again at zero
        out["workers"].append(_worker(w, b, a if same else None, dt))
        for m in w.models:
            prev = next((o for o in old.models if o.name == m.name), None) if same and old else None
            _add_model(out["models"].setdefault(m.name, _empty_model()), m, prev, dt)
    if isinstance(health, P.HealthReply):
        for mh in health.models:
            entry = out["models"].setdefault(mh.name, _empty_model())
            entry.update(ready=mh.ready, workers_ready=mh.workers_ready, reason=mh.reason)
    for entry in out["models"].values():
        entry["latency_us"] = {k: _percentiles(h) for k, h in entry.pop("_stages").items()}
        rows = entry.pop("_rows")  # popped first: inside the conditional it stayed in the output when batches == 0
        entry["mean_batch"] = round(rows / entry["batches"], 2) if entry["batches"] else None
    out["gpus"] = [vars(s) for s in gpu_samples(sorted({int(w["device"]) for w in out["workers"]
                                                         if str(w["device"]).isdigit()}))]
    return out


def _worker(w: P.WorkerStats, b: Sample, a: Sample | None, dt: float) -> dict[str, Any]:
    cpu = None
    if a is not None and w.pid in a.cpu and w.pid in b.cpu:
        cpu = round(100.0 * (b.cpu[w.pid] - a.cpu[w.pid]) / dt, 1)
    try:
        rss: int | None = psutil.Process(w.pid).memory_info().rss
    except psutil.Error:
        rss = None
    return {"worker_id": w.worker_id, "pid": w.pid, "device": w.device, "restarts": w.restarts,
            "in_flight": w.in_flight, "cpu_percent": cpu, "rss_bytes": rss,
            "queue_depth": sum(m.queue_depth for m in w.models)}


def _empty_model() -> dict[str, Any]:
    return {"queue_depth": 0, "requests": {}, "throughput_rps": 0.0, "batches": 0, "_rows": 0, "_stages": {},
            "ready": False, "workers_ready": 0, "reason": ""}


def _add_model(entry: dict[str, Any], m: P.ModelStats, prev: P.ModelStats | None, dt: float) -> None:
    entry["queue_depth"] += m.queue_depth
    for code, n in m.requests.items():
        entry["requests"][code] = entry["requests"].get(code, 0) + n
    answered = sum(m.requests.values()) - (sum(prev.requests.values()) if prev else 0)
    entry["throughput_rps"] = round(entry["throughput_rps"] + max(answered, 0) / dt, 1)
    entry["batches"] += m.batches
    entry["_rows"] += sum(int(k) * v for k, v in m.batch_items.items())
    old_stages = getattr(prev, "stages", {}) if prev else {}
    for name, h in getattr(m, "stages", {}).items():
        d = _delta(h, old_stages.get(name))
        have = entry["_stages"].get(name)
        entry["_stages"][name] = d if have is None else _sum(have, d)


def _delta(h: P.StageHistogram, old: P.StageHistogram | None) -> P.StageHistogram:
    """The observations made since ``old`` (the same worker's previous sample)."""
    if old is None or old.bounds_us != h.bounds_us:
        return h
    counts = [max(x - y, 0) for x, y in zip(h.counts, old.counts, strict=True)]
    return P.StageHistogram(h.bounds_us, counts, sum(counts), h.sum_us - old.sum_us, h.max_us)


def _sum(x: P.StageHistogram, y: P.StageHistogram) -> P.StageHistogram:
    if x.bounds_us != y.bounds_us:
        return x
    counts = [i + j for i, j in zip(x.counts, y.counts, strict=True)]
    return P.StageHistogram(x.bounds_us, counts, x.count + y.count, x.sum_us + y.sum_us, max(x.max_us, y.max_us))


def _percentiles(h: P.StageHistogram) -> dict[str, float | None]:
    from shmbroker.gpu_worker.histogram import quantile

    return {f"p{round(q * 100)}": quantile(h, q) for q in QUANTILES}


def render(snap: dict[str, Any]) -> Any:
    """The live view of one snapshot: a workers table, a models table and, where present, GPUs."""
    from rich.console import Group
    from rich.table import Table

    state = "[green]ready[/]" if snap["ready"] else "[red]NOT READY[/]"
    workers = Table(title=f"shmbroker  {state}  (rates over {snap['interval_s']:.1f} s)", title_justify="left")
    for col in ("worker", "device", "pid", "restarts", "in flight", "queued", "CPU %", "RSS MiB"):
        workers.add_column(col, justify="right")
    for w in snap["workers"]:
        workers.add_row(str(w["worker_id"]), w["device"], str(w["pid"]), str(w["restarts"]), str(w["in_flight"]),
                        str(w["queue_depth"]), _fmt(w["cpu_percent"]),
                        _fmt(w["rss_bytes"] / 2**20 if w["rss_bytes"] is not None else None))
    models = Table()
    for col in ("model", "ready", "queue", "req/s", "OK", "errors", "mean batch", "latency p50/p99 (us)"):
        models.add_column(col, justify="right")
    for name, m in snap["models"].items():
        errors = sum(n for code, n in m["requests"].items() if code != "OK")
        latency = " ".join(f"{stage} {_fmt(q['p50'])}/{_fmt(q['p99'])}" for stage, q in m["latency_us"].items())
        models.add_row(name, "yes" if m["ready"] else f"[red]no[/] {m['reason']}", str(m["queue_depth"]),
                       _fmt(m["throughput_rps"]), str(m["requests"].get("OK", 0)), str(errors),
                       _fmt(m["mean_batch"]), latency or "-")
    parts: list[Any] = [workers, models]
    if snap["gpus"]:
        gpus = Table()
        for col in ("gpu", "util %", "memory used / total GiB"):
            gpus.add_column(col, justify="right")
        for g in snap["gpus"]:
            gpus.add_row(str(g["index"]), _fmt(100 * g["utilization"]),
                         f"{g['memory_used'] / 2**30:.1f} / {g['memory_total'] / 2**30:.1f}")
        parts.append(gpus)
    return Group(*parts)


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def live(runtime_dir: Path, interval: float, count: int = 0) -> None:
    """Refresh the view every ``interval`` seconds until Ctrl-C, or ``count`` times when it is positive."""
    from rich.live import Live

    prev = sample(runtime_dir)
    time.sleep(interval)  # the first rates need an interval, like every refresh after it
    with Live(render(snapshot(runtime_dir, interval, prev)), auto_refresh=False) as view:
        n = 1
        while count <= 0 or n < count:
            prev = sample(runtime_dir)
            time.sleep(interval)
            view.update(render(snapshot(runtime_dir, interval, prev)), refresh=True)
            n += 1
