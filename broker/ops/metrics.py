"""Prometheus metrics for /metrics: one custom Collector that turns the broker's view into metric families.

Multiprocess set-up, and why not ``PROMETHEUS_MULTIPROC_DIR``: the workers are separate processes that
already keep their own per-model counters (``gpu_worker.work.ModelCounters``) and report them to the
broker over ZeroMQ (STATS). At each scrape this collector asks the broker for those reports, exactly as
``shmbroker stats`` does, and builds the families from them. prometheus-client's multiprocess mode would
instead make every worker write its metrics into mmap'ed files on the hot path, needs the directory wiped
when a worker restarts (the dead pid's files otherwise keep counting), and does not carry custom collectors
or the live gauges we need (queue depth). A worker's counters restart at zero with the worker; Prometheus's
``rate()`` handles such resets, and ``shmbroker_worker_restarts_total`` says when they happened.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import psutil
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from shmbroker.broker.common import protocol as P
from shmbroker.broker.common.ask import ask_broker
from shmbroker.broker.common.config import Config
from shmbroker.broker.ops.gpu_info import gpu_samples
from shmbroker.broker.ops.probe import Prober

log = logging.getLogger(__name__)

ASK_TIMEOUT_S = 5.0
BATCH_BOUNDS = tuple(float(2**k) for k in range(13))  # 1 .. 4096 rows


def build_registry(cfg: Config, runtime_dir: Path, prober: Prober | None) -> CollectorRegistry:
    """A registry holding only shmbroker's collector (no default process collector: ours labels each process)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(BrokerCollector(cfg, runtime_dir, prober))
    return registry


class BrokerCollector(Collector):
    """Each ``collect`` asks the broker's serving loop for STATS and HEALTH over its control socket."""

    def __init__(self, cfg: Config, runtime_dir: Path, prober: Prober | None) -> None:
        self.cfg = cfg
        self.runtime_dir = runtime_dir
        self.prober = prober
        self.broker_pid = os.getpid()
        self._procs: dict[int, psutil.Process] = {}  # kept so cpu_percent-style state and lookups are cheap

    def collect(self) -> Iterator[Metric]:
        stats = ask_broker(self.runtime_dir, P.StatsRequest(), ASK_TIMEOUT_S)
        health = ask_broker(self.runtime_dir, P.Health(0), ASK_TIMEOUT_S)
        up = GaugeMetricFamily("shmbroker_up", "1 when the broker's serving loop answered this scrape")
        up.add_metric([], 1.0 if isinstance(stats, P.StatsReply) else 0.0)
        yield up
        workers = stats.workers if isinstance(stats, P.StatsReply) else []
        yield from worker_families(workers)
        if isinstance(health, P.HealthReply):
            yield from health_families(health)
        if self.prober is not None:
            yield from probe_families(self.prober)
        yield from self._process_families(workers)
        yield from gpu_families(self.cfg)

    def _process_families(self, workers: list[P.WorkerStats]) -> Iterator[Metric]:
        cpu = CounterMetricFamily("shmbroker_process_cpu_seconds", "user + system CPU time of a process",
                                  labels=["process", "worker"])
        rss = GaugeMetricFamily("shmbroker_process_resident_memory_bytes", "resident set size of a process",
                                labels=["process", "worker"])
        procs = [("broker", "", self.broker_pid)]
        # in thread mode a worker is the broker process itself: counted once, as the broker
        procs += [("worker", str(w.worker_id), w.pid) for w in workers if w.pid != self.broker_pid]
        for role, wid, pid in procs:
            try:
                p = self._procs.get(pid) or psutil.Process(pid)
                self._procs[pid] = p
                with p.oneshot():
                    t, mem = p.cpu_times(), p.memory_info()
            except psutil.Error:
                self._procs.pop(pid, None)
                continue  # the worker died since its stats were sent; the next scrape sees its successor
            cpu.add_metric([role, wid], t.user + t.system)
            rss.add_metric([role, wid], float(mem.rss))
        live = {pid for _r, _w, pid in procs}
        self._procs = {pid: p for pid, p in self._procs.items() if pid in live}
        yield cpu
        yield rss


def worker_families(workers: Iterable[P.WorkerStats]) -> Iterator[Metric]:
    """Requests by code, batch sizes, queue depth, in flight, restarts and stage durations, per worker."""
    requests = CounterMetricFamily("shmbroker_requests", "requests answered, by model and result code",
                                   labels=["model", "worker", "code"])
    batch = HistogramMetricFamily("shmbroker_batch_size", "rows per batch run by the engine",
                                  labels=["model", "worker"])
    depth = GaugeMetricFamily("shmbroker_queue_depth", "requests queued for a batch", labels=["model", "worker"])
    in_flight = GaugeMetricFamily("shmbroker_worker_requests_in_flight",
                                  "requests a worker accepted and has not answered yet (all models)",
                                  labels=["worker"])
    restarts = CounterMetricFamily("shmbroker_worker_restarts", "times the broker restarted this worker",
                                   labels=["worker"])
    stages = HistogramMetricFamily("shmbroker_stage_duration_seconds",
                                   "GPU pipeline stage durations: queue (per request), h2d, wait, compute, d2h, "
                                   "wake, answer",
                                   labels=["model", "worker", "stage"])
    for w in workers:
        wid = str(w.worker_id)
        in_flight.add_metric([wid], float(getattr(w, "in_flight", 0)))
        restarts.add_metric([wid], float(w.restarts))
        for m in w.models:
            for code, n in sorted(m.requests.items()):
                requests.add_metric([m.name, wid, code], float(n))
            buckets, total = batch_buckets(m.batch_items)
            batch.add_metric([m.name, wid], buckets, total)
            depth.add_metric([m.name, wid], float(m.queue_depth))
            for stage, h in sorted(getattr(m, "stages", {}).items()):
                stages.add_metric([m.name, wid, stage], *stage_buckets(h))
    yield from (requests, batch, depth, in_flight, restarts, stages)


def batch_buckets(batch_items: dict[str, int]) -> tuple[list[tuple[str, float]], float]:
    """Cumulative buckets at powers of two (the exact sizes are in ``shmbroker stats``) and the sum of rows."""
    sizes = sorted((int(k), n) for k, n in batch_items.items())
    out = [(repr(bound), float(sum(n for size, n in sizes if size <= bound))) for bound in BATCH_BOUNDS]
    out.append(("+Inf", float(sum(n for _s, n in sizes))))
    return out, float(sum(size * n for size, n in sizes))


def stage_buckets(h: P.StageHistogram) -> tuple[list[tuple[str, float]], float]:
    """A worker's fixed-bucket histogram (microseconds) as cumulative Prometheus buckets in seconds."""
    out, seen = [], 0
    for bound, n in zip(h.bounds_us, h.counts, strict=False):
        seen += n
        out.append((repr(bound / 1e6), float(seen)))
    out.append(("+Inf", float(h.count)))
    return out, h.sum_us / 1e6


def health_families(health: P.HealthReply) -> Iterator[Metric]:
    ready = GaugeMetricFamily("shmbroker_model_workers_ready", "workers serving the model that passed warm-up",
                              labels=["model"])
    for m in health.models:
        ready.add_metric([m.name], float(m.workers_ready))
    yield ready


def probe_families(prober: Prober) -> Iterator[Metric]:
    probes = CounterMetricFamily("shmbroker_health_probes", "dummy inferences run by the broker's prober",
                                 labels=["model", "result"])
    age = GaugeMetricFamily("shmbroker_health_probe_age_seconds", "time since the model last passed a probe",
                            labels=["model"])
    now = time.monotonic()
    for name, s in prober.snapshot().items():
        probes.add_metric([name, "ok"], float(s.ok))
        probes.add_metric([name, "failed"], float(s.failed))
        if s.last_ok:
            age.add_metric([name], now - s.last_ok)
    yield probes
    yield age


def gpu_families(cfg: Config) -> Iterator[Metric]:
    """GPU utilization and memory of the configured GPU devices; nothing without nvidia-ml-py or a GPU."""
    samples = gpu_samples([d for d in cfg.worker.devices if isinstance(d, int)])
    if not samples:
        return
    util = GaugeMetricFamily("shmbroker_gpu_utilization_ratio", "GPU busy fraction over the driver's last period",
                             labels=["gpu"])
    used = GaugeMetricFamily("shmbroker_gpu_memory_used_bytes", "GPU memory in use (all processes)", labels=["gpu"])
    total = GaugeMetricFamily("shmbroker_gpu_memory_total_bytes", "GPU memory", labels=["gpu"])
    for s in samples:
        util.add_metric([str(s.index)], s.utilization)
        used.add_metric([str(s.index)], float(s.memory_used))
        total.add_metric([str(s.index)], float(s.memory_total))
    yield from (util, used, total)
