"""(c) shmbroker under load, and what is sampled meanwhile.

Each client process keeps ``in_flight`` batch-1 requests outstanding with ``Client.call`` (a request's
callback submits the next, as in bench/load.py) and times every request from submit to callback; with the
``infer`` API, ``in_flight`` threads each call ``Client.infer`` in a loop, timed from call to return; with the
``request`` API, each thread writes its input into a held slot in place (``Client.request``, as an application
that decodes straight into the slot does) and times ``run()``, from the input in the slot to the outputs
readable there, as the in-process lone figure times its input in page-locked memory to its outputs. Its
window's start and end are reported on the system-wide monotonic clock, so that the bench process can pick
the GPU utilization samples and the broker's stats that fall inside the window.

``Sampler`` (a thread of the bench process): NVML's GPU utilization (the share of time a kernel ran, as
nvidia-smi shows it) every 0.1 s, and the broker's stats every 0.5 s.
"""

from __future__ import annotations

import collections
import importlib
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import psutil

from shmbroker.bench import cpu_sample
from shmbroker.bench.common import ChainSet, Figures, Progress, latency_summary
from shmbroker.bench.procs import Sync, Target, run_group
from shmbroker.broker.common import protocol as P
from shmbroker.broker.common.ask import ask_broker
from shmbroker.client import Client, ShmBrokerError
from shmbroker.gpu_worker.histogram import mean, quantile
from shmbroker.gpu_worker.streams import EVENT_STAGES


class BurstGaps:
    """How a client's answers arrive: answers closer than ``BURST_NS`` to the one before are one burst (one
    wake-up of its receiving thread); the gaps between bursts, counted by how a spin of the client's
    ``spin_us`` (1 ms by default) would meet them: within 1 ms (a spin catches the next burst), within 4 ms
    (the IO thread's reach, broker.common.spin: it spins then) or later."""

    BURST_NS = 50_000

    def __init__(self) -> None:
        self.last = 0
        self.answers = self.bursts = self.within_1ms = self.within_4ms = 0

    def add(self, t: int) -> None:
        self.answers += 1
        gap = t - self.last
        self.last = t
        if gap < self.BURST_NS:
            return
        self.bursts += 1
        if gap < 1_000_000:
            self.within_1ms += 1
        elif gap < 4_000_000:
            self.within_4ms += 1

    def counts(self) -> dict[str, int]:
        return {"answers": self.answers, "bursts": self.bursts, "within_1ms": self.within_1ms,
                "within_4ms": self.within_4ms}

    @staticmethod
    def merge(counts: list[dict[str, int]]) -> Figures | None:
        """The processes' counts as answers a burst and each gap class's share of the gaps."""
        total = {k: sum(c[k] for c in counts) for k in ("answers", "bursts", "within_1ms", "within_4ms")}
        if not total["bursts"]:
            return None
        gaps = total["bursts"]
        return {"answers_per_burst": round(total["answers"] / gaps, 2),
                "gaps_within_1ms_pct": round(100 * total["within_1ms"] / gaps, 1),
                "gaps_1_to_4ms_pct": round(100 * total["within_4ms"] / gaps, 1)}


class Chains(ChainSet):
    """``in_flight`` chains; chain i's request was submitted at ``sent[i]``; completions in the window count."""

    def __init__(self, client: Client, model: str, x: Any, t_count: float, t_end: float, n: int) -> None:
        super().__init__(n)
        self.client, self.model, self.x = client, model, x
        self.t_count, self.t_end = t_count, t_end
        self.sent = [0] * n
        self.samples: list[int] = []
        self.errors: collections.Counter[str] = collections.Counter()
        self.answered = 0  # every answer, in the window or not: the client's CPU time is divided by it
        self.ended_cpu_s = 0.0  # CPU seconds of the threads ``run`` started and ended (Loops)
        self.bursts = BurstGaps()

    def inputs(self) -> Any:
        """The next request's inputs (the same array each time; bench/photo_load.py goes through its photos)."""
        return self.x

    def launch(self, i: int) -> None:
        self.sent[i] = time.perf_counter_ns()
        try:
            self.client.call(self.model, self.inputs(), lambda out, exc: self.on_done(i, exc))
        except ShmBrokerError as exc:
            with self.lock:
                self.errors[f"submit:{exc.code}"] += 1
            self._ended()

    def on_done(self, i: int, exc: ShmBrokerError | None) -> None:
        t = time.perf_counter_ns()
        now = t / 1e9
        self.answered += 1  # on the client's one receiving thread
        self.bursts.add(t)
        if self.t_count <= now < self.t_end:
            with self.lock:
                if exc is None:
                    self.samples.append(t - self.sent[i])
                else:
                    self.errors[getattr(exc, "code", type(exc).__name__)] += 1
        if now < self.t_end:
            self.launch(i)
        else:
            self._ended()

    def run(self, timeout: float) -> bool:
        """Start every chain; whether all ended within ``timeout`` seconds."""
        for i in range(len(self.sent)):
            self.launch(i)
        return self.drained.wait(timeout)


class Loops(Chains):
    """``in_flight`` threads (the first is the caller's), each calling ``Client.infer`` in a loop, as a
    synchronous application does; a request is timed from the call to its return."""

    def run(self, timeout: float) -> bool:
        threads = [threading.Thread(target=self._timed_loop, name=f"bench-infer-{i}", daemon=True)
                   for i in range(1, len(self.sent))]
        for t in threads:
            t.start()
        self._loop()
        for t in threads:
            t.join(timeout)
        return not any(t.is_alive() for t in threads)

    def _timed_loop(self) -> None:
        """``_loop`` on a thread of its own, whose CPU time counts in ``ended_cpu_s``."""
        t0 = time.thread_time()
        self._loop()
        with self.lock:
            self.ended_cpu_s += time.thread_time() - t0

    def _loop(self) -> None:
        samples: list[int] = []
        errors: collections.Counter[str] = collections.Counter()
        answered = 0
        while time.perf_counter_ns() / 1e9 < self.t_end:
            t0, t, code = self._one()
            answered += 1
            if self.t_count <= t / 1e9 < self.t_end:
                if code:
                    errors[code] += 1
                else:
                    samples.append(t - t0)
        with self.lock:
            self.samples += samples
            self.errors += errors
            self.answered += answered
            self.live -= 1

    def _one(self) -> tuple[int, int, str]:
        """One request: when its timing starts and ends, and its error code ('' for none)."""
        t0 = time.perf_counter_ns()
        try:
            self.client.infer(self.model, self.inputs())
            code = ""
        except ShmBrokerError as exc:
            code = exc.code
        return t0, time.perf_counter_ns(), code


class InPlace(Loops):
    """As ``Loops``, with zero-copy requests: the input is written into the held slot before the timing starts,
    and the outputs are read in place."""

    def _one(self) -> tuple[int, int, str]:
        t0 = 0
        try:
            with self.client.request(self.model) as req:
                next(iter(req.inputs.values()))[...] = self.x
                t0 = time.perf_counter_ns()
                req.run()
                return t0, time.perf_counter_ns(), ""
        except ShmBrokerError as exc:
            t = time.perf_counter_ns()
            return t0 or t, t, exc.code


API_LOOPS: dict[str, type[Chains]] = {"call": Chains, "infer": Loops, "request": InPlace}  # by --api


def client(spec: dict[str, Any], sync: Sync) -> Figures:
    """One application process: its own session, ``in_flight`` batch-1 requests in flight for the window."""
    x = np.random.default_rng(spec["seed"]).random(tuple(spec["shape"]), dtype=np.float32)
    kind = API_LOOPS[spec.get("api", "call")]
    return drive(spec, sync, lambda c: kind(c, spec["model"], x, 0.0, 0.0, spec["in_flight"]))


def drive(spec: dict[str, Any], sync: Sync, make: Callable[[Client], Chains]) -> Figures:
    """One client process's run: its session, ``warmup_requests`` of the inputs of ``make``'s chains, then, once
    all processes are ready, one window of new chains; the answers timed in it and the CPU time spent."""
    with _session(spec) as c:
        _warm_up(c, spec, make(c))
        sync()
        return _window(make(c), spec)


def drive_rounds(spec: dict[str, Any], sync: Sync, make: Callable[[Client], Chains]) -> Figures:
    """As ``drive``, with one window per round (``spec["rounds"]``), on ``spec["round_barrier"]``, which the bench
    shares to measure its baseline between the windows: once when all processes are ready, then as each window
    starts and as it has drained. {"rounds": [window figures]}. A failure aborts the barrier, so nobody waits for
    a round that will not come."""
    barrier, timeout = spec["round_barrier"], spec["round_timeout_s"]
    with _session(spec) as c:
        _warm_up(c, spec, make(c))
        sync()
        out = []
        try:
            barrier.wait(timeout)
            for _ in range(spec["rounds"]):
                barrier.wait(timeout)
                out.append(_window(make(c), spec))
                barrier.wait(timeout)
        except BaseException:
            barrier.abort()
            raise
    return {"rounds": out}


def _session(spec: dict[str, Any]) -> Client:
    return Client(spec["runtime_dir"], slots=2 * spec["in_flight"], name=f"bench-gpu-{spec['index']}",
                  spin_us=spec.get("spin_us", 1000))


def _warm_up(c: Client, spec: dict[str, Any], chains: Chains) -> None:
    for _ in range(spec["warmup_requests"]):
        c.infer(spec["model"], chains.inputs())


def _window(chains: Chains, spec: dict[str, Any]) -> Figures:
    """From now: ``warmup_s`` uncounted, then ``duration_s`` counted, then the drain."""
    t0 = time.perf_counter()
    w0 = time.monotonic() + spec["warmup_s"]
    chains.t_count, chains.t_end = t0 + spec["warmup_s"], t0 + spec["warmup_s"] + spec["duration_s"]
    cpu0, switched0 = time.process_time(), psutil.Process().num_ctx_switches().involuntary
    threads0 = _own_threads()
    drained = chains.run(spec["warmup_s"] + spec["duration_s"] + 30.0)
    cpu_s = time.process_time() - cpu0
    threads1 = _own_threads()
    preempted = psutil.Process().num_ctx_switches().involuntary - switched0
    with chains.lock:
        samples, errors = list(chains.samples), dict(chains.errors)
    return {"completed": len(samples), "errors": sum(errors.values()), "error_codes": errors,
            "samples_ns": samples, "window_s": spec["duration_s"], "lost": 0 if drained else chains.live,
            "window_monotonic": [w0, w0 + spec["duration_s"]], "cpu_s": cpu_s, "preempted": preempted,
            "cpu_s_by_thread": _thread_deltas(threads0, threads1, chains.ended_cpu_s),
            "answered": chains.answered, "bursts": chains.bursts.counts()}


def group(progress: Progress, target: Target, specs: list[dict[str, Any]], sampler: Sampler,
          warmup_s: float, duration_s: float) -> Figures:
    """Client processes running ``target`` (bench/gpu_load.py's figures each) with ``sampler`` on: ``merge``'s
    figures of their one window."""
    sampler.start()
    try:
        results = run_group(progress, target, specs, warmup_s + duration_s)
    finally:
        sampler.stop()
    return merge(results, duration_s, sampler)


def merge(results: list[Figures], duration_s: float, sampler: Sampler) -> Figures:
    """One window of several client processes: answers/s, their latency, GPU busy and the clients' CPU time per
    answer, over the window all of them shared."""
    t0 = max(r["window_monotonic"][0] for r in results)
    t1 = min(r["window_monotonic"][1] for r in results)
    samples = [x for r in results for x in r["samples_ns"]]
    completed = sum(r["completed"] for r in results)
    return {"per_s": round(completed / duration_s, 1), "completed": completed,
            "errors": sum(r["errors"] for r in results), "latency": latency_summary(samples),
            "gpu_busy_pct": sampler.busy_pct(t0, t1), "gpu_busy_error": sampler.error,
            "client_cpu_us_per_request": _per_answer(results, "cpu_s", 1e6),
            "client_cpu_us_by_thread": client_threads(results),
            "client_preempted_per_1k_requests": _per_answer(results, "preempted", 1e3),
            "answer_bursts": BurstGaps.merge([r["bursts"] for r in results if "bursts" in r]),
            "window_monotonic": [t0, t1]}


def _per_answer(results: list[Figures], key: str, scale: float) -> float | None:
    """The client processes' ``key`` summed, times ``scale``, per answered request, over their whole run (warm-up
    included): their CPU seconds (``cpu_s``, 1e6: microseconds), or their preemptions (``preempted``, 1e3: per
    1000 requests)."""
    answered = sum(r.get("answered", 0) for r in results)
    return round(sum(r.get(key, 0) for r in results) * scale / answered, 2) if answered else None


def _thread_deltas(before: cpu_sample.CpuSample, after: cpu_sample.CpuSample, ended: float) -> cpu_sample.CpuSample:
    """Each thread name's CPU seconds between the samples, and as "ended" those of the threads that ended in
    between (the infer API's callers), which the second sample no longer sees."""
    out = {k: v - before.get(k, 0.0) for k, v in after.items()}
    if ended > 0:
        out["ended"] = ended
    return out


def _own_threads() -> cpu_sample.CpuSample:
    """This process's CPU seconds by thread name, its own name (each client process has one) as "caller"."""
    own = Path("/proc/self/comm").read_text().strip()
    return {("caller" if name == own else name): sec for name, sec in cpu_sample.threads(os.getpid()).items()}


def client_threads(results: list[Figures]) -> dict[str, float]:
    """The client processes' CPU by thread name (``cpu_s_by_thread``: the client's IO thread, ZeroMQ's, the
    callers'), summed, in microseconds per answered request, the largest first, with a total."""
    answered = sum(r.get("answered", 0) for r in results)
    summed: cpu_sample.CpuSample = {}
    for r in results:
        for name, sec in r.get("cpu_s_by_thread", {}).items():
            summed[name] = summed.get(name, 0.0) + sec
    return cpu_sample.per_request({}, summed, answered)


@dataclass(frozen=True)
class Snapshot:
    """The broker's stats at ``t`` (time.monotonic()); each worker's threads' CPU seconds then, the seconds they
    had waited for a core and how often they were preempted; and the machine's CPU times."""

    t: float
    stats: P.StatsReply
    cpu: dict[int, cpu_sample.CpuSample]  # worker pid -> its threads
    waits: dict[int, cpu_sample.CpuSample]  # worker pid -> its threads' run-queue delay
    preempted: dict[int, cpu_sample.CpuSample]  # worker pid -> its threads' nonvoluntary switches
    host: Any  # psutil.cpu_times(): the whole machine's CPU seconds by kind, steal (the hypervisor's) included


class Sampler(threading.Thread):
    """GPU utilization (NVML; none with ``device`` None, a CPU worker's) and, when ``runtime_dir`` is given, the
    broker's stats, with monotonic times."""

    def __init__(self, device: int | None, runtime_dir: Path | None = None, period_s: float = 0.1) -> None:
        super().__init__(name="bench-sampler", daemon=True)
        self.device, self.runtime_dir, self.period_s = device, runtime_dir, period_s
        self.util: list[tuple[float, int]] = []
        self.stats: list[Snapshot] = []
        self.error: str | None = None
        self._stop_event = threading.Event()

    def run(self) -> None:
        pynvml: Any = None
        if self.device is None:
            self.error = "no GPU: the worker runs on the CPU"
        else:
            try:
                pynvml = importlib.import_module("pynvml")
                pynvml.nvmlInit()
            except Exception as exc:  # noqa: BLE001 - no NVML: the figure is reported as missing, with why
                self.error = f"NVML unavailable: {type(exc).__name__}: {exc}"
                pynvml = None
        handle = pynvml.nvmlDeviceGetHandleByIndex(self.device) if pynvml else None
        next_stats = 0.0
        try:
            while not self._stop_event.wait(self.period_s):
                now = time.monotonic()
                if pynvml is not None:
                    self.util.append((now, int(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)))
                if self.runtime_dir is not None and now >= next_stats:
                    reply = ask_broker(self.runtime_dir, P.StatsRequest(), 2.0)
                    if isinstance(reply, P.StatsReply):
                        cpu = {w.pid: cpu_sample.threads(w.pid) for w in reply.workers}
                        waits = {w.pid: cpu_sample.run_waits(w.pid) for w in reply.workers}
                        preempted = {w.pid: cpu_sample.preemptions(w.pid) for w in reply.workers}
                        self.stats.append(Snapshot(time.monotonic(), reply, cpu, waits, preempted,
                                                   psutil.cpu_times()))
                    next_stats = now + 0.5
        finally:
            if pynvml is not None:
                pynvml.nvmlShutdown()

    def stop(self) -> None:
        self._stop_event.set()
        self.join(10.0)

    def busy_pct(self, t0: float, t1: float) -> float | None:
        inside = [u for t, u in self.util if t0 <= t <= t1]
        return round(sum(inside) / len(inside), 1) if inside else None

    def stats_window(self, t0: float, t1: float) -> tuple[Snapshot, Snapshot] | None:
        """The first stats snapshot at or after ``t0`` and the last at or before ``t1``."""
        first = next((s for s in self.stats if s.t >= t0), None)
        last = next((s for s in reversed(self.stats) if s.t <= t1), None)
        if first is None or last is None or last.t <= first.t:
            return None
        return first, last


def worker_cpu(before: Snapshot, after: Snapshot, model: str, what: Literal["cpu", "waits", "preempted"] = "cpu",
               per: Literal["request", "row"] = "request") -> Figures:
    """Each worker's figure per request (or per row its batches ran) of ``model`` between two snapshots, by thread
    name: ``what`` "cpu", CPU microseconds; "waits", microseconds waited for a core; "preempted", nonvoluntary
    switches per 1000."""
    a, b = _model(after.stats, model), _model(before.stats, model)
    if a is None or b is None:
        return {"error": f"no stats for model {model!r}"}
    count = _rows if per == "row" else (lambda m: sum(m.requests.values()))
    requests = count(a) - count(b)
    first: dict[int, cpu_sample.CpuSample] = getattr(before, what)
    last: dict[int, cpu_sample.CpuSample] = getattr(after, what)
    scale = 1e3 if what == "preempted" else 1e6
    return {str(pid): cpu_sample.per_request(first.get(pid, {}), sample, requests, scale)
            for pid, sample in last.items()}


def _rows(m: P.ModelStats) -> int:
    """Rows of every batch the model ran (a request of images carries several)."""
    return sum(int(rows) * n for rows, n in m.batch_items.items())


def host_cpu(before: Snapshot, after: Snapshot) -> Figures:
    """The machine's CPU between two snapshots, in % of all its cores: busy (not idle nor waiting on IO), and
    stolen (a virtual machine's cores running another guest): a run that is slow for no reason of its own shows
    in the second."""
    a, b = after.host._asdict(), before.host._asdict()
    diff = {k: a[k] - b[k] for k in a if k not in ("guest", "guest_nice")}  # already counted in user and nice
    total = sum(diff.values())
    if total <= 0:
        return {}
    idle = diff.get("idle", 0.0) + diff.get("iowait", 0.0)
    return {"busy_pct": round(100 * (total - idle - diff.get("steal", 0.0)) / total, 1),
            "steal_pct": round(100 * diff.get("steal", 0.0) / total, 2)}


def _model(reply: P.StatsReply, name: str) -> P.ModelStats | None:
    return next((m for w in reply.workers for m in w.models if m.name == name), None)


def stage_figures(before: P.StatsReply, after: P.StatsReply, model: str, seconds: float) -> Figures:
    """Per-stage times between two stats snapshots (bucket counts subtracted), batches, event-timed busy."""
    a, b = _model(after, model), _model(before, model)
    if a is None or b is None:
        return {"error": f"no stats for model {model!r}"}
    out: Figures = {}
    for stage, h in a.stages.items():
        h0 = b.stages.get(stage)
        d = P.StageHistogram(h.bounds_us, [x - y for x, y in zip(h.counts, h0.counts, strict=True)] if h0 else h.counts,
                             h.count - (h0.count if h0 else 0), h.sum_us - (h0.sum_us if h0 else 0.0), h.max_us)
        out[stage] = {"count": d.count, "mean_us": _round(mean(d)), "p50_us": _round(quantile(d, 0.5)),
                      "p99_us": _round(quantile(d, 0.99))}
    if "compute" in a.stages and b.stages.get("compute") is not None:
        busy_us = a.stages["compute"].sum_us - b.stages["compute"].sum_us
        # the share of the window the device computed; computes side by side overlap and may pass 100
        out["compute_busy_pct"] = round(100 * busy_us / (seconds * 1e6), 1)
    batches = a.batches - b.batches
    items = sum(int(k) * v for k, v in a.batch_items.items()) - sum(int(k) * v for k, v in b.batch_items.items())
    out["batches"] = batches
    out["mean_batch"] = round(items / batches, 2) if batches else None
    sizes = {k: v - b.batch_items.get(k, 0) for k, v in a.batch_items.items()}
    out["batch_sizes"] = {k: n for k, n in sorted(sizes.items(), key=lambda kv: int(kv[0])) if n}
    out["seconds"] = round(seconds, 2)
    return out


# a request's path through the worker: its wait in the batcher, then its batch's stages to its last DONE sent
# (gpu_worker/pipeline.py's STAGES but ``wake``, a part of ``answer``)
WORKER_STAGES = ("queue", *EVENT_STAGES, "answer")


def outside_worker_ms(latency: Figures, stages: Figures) -> float | None:
    """A request's mean time outside the worker's stages, in ms: the clients' own, the sockets', and the wait
    for the worker's IO thread to take it in; what is left of the mean latency after the stages' means (None
    where a stage is missing). With a fixed number in flight, the more of them are out there, the fewer the
    worker batches (bench/RESULTS.md#two-more-starts-the-completion-threads-wake-up-and-three-variants)."""
    means = [stages.get(k, {}).get("mean_us") for k in WORKER_STAGES]
    total = latency.get("mean_us")
    if total is None or any(m is None for m in means):
        return None
    return round((float(total) - sum(float(m) for m in means)) / 1e3, 2)


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 1)
