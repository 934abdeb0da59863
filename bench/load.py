"""Client processes that load the broker: sequential ``infer`` for latency, ``call`` chains for throughput.

Throughput: each process keeps ``in_flight`` requests outstanding with ``Client.call``, the client's
callback API (no Future). A request's callback (run by the client's IO thread) submits the next one, so a
completion and the next submission cost no thread hand-off, and the client coalesces them into one
SUBMIT per worker. The session has ``2 * in_flight`` slots, as an application would give itself headroom.
The concurrency sweep (``sweep_client``) runs the same chains with each request also timed from submit to
completion (``_TimedChains``); the throughput phases keep the untimed chains, so they pay nothing for it.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

import numpy as np

from shmbroker.bench.common import BenchError, Figures, latency_summary
from shmbroker.bench.procs import Sync
from shmbroker.client import Client, ShmBrokerError


def _inputs(client: Client, model: str, rows: int, seed: int) -> dict[str, np.ndarray]:
    """Random inputs of the model's declared dtypes, ``rows`` items each."""
    plan = client.models.get(model)
    if plan is None:
        raise BenchError(f"the broker does not serve model {model!r}; it serves {sorted(client.models)}")
    rng = np.random.default_rng(seed)
    feeds = {}
    for k, spec in enumerate(plan.info.inputs):
        shape = (rows, *plan.in_item_shapes[k])
        dt = plan.in_dtypes[k]
        if dt.kind == "f":
            feeds[spec.name] = rng.random(shape, dtype=np.float32).astype(dt)
        elif dt.kind == "b":
            feeds[spec.name] = rng.integers(0, 2, shape).astype(dt)
        else:
            feeds[spec.name] = rng.integers(0, 100, shape).astype(dt)
    return feeds


def latency_client(spec: dict[str, Any], sync: Sync) -> Figures:
    """Concurrency 1: ``requests`` sequential ``Client.infer`` calls after ``warmup`` untimed ones."""
    model: str = spec["model"]
    with Client(spec["runtime_dir"], name="bench-latency") as c:
        x = _inputs(c, model, 1, spec["seed"])
        for _ in range(spec["warmup"]):
            c.infer(model, x)
        sync()
        samples = []
        errors: collections.Counter[str] = collections.Counter()
        clock = time.perf_counter_ns
        for _ in range(spec["requests"]):
            t0 = clock()
            try:
                c.infer(model, x)
            except ShmBrokerError as exc:
                errors[exc.code] += 1
                continue
            samples.append(clock() - t0)
    return {"latency": latency_summary(samples), "errors": sum(errors.values()), "error_codes": dict(errors)}


class _Chains:
    """``in_flight`` chains of requests: each completion counts (inside the window) and submits the next."""

    def __init__(self, client: Client, model: str, feeds: dict[str, np.ndarray], t_count: float, t_end: float,
                 in_flight: int) -> None:
        self.client = client
        self.model = model
        self.feeds = feeds
        self.t_count = t_count
        self.t_end = t_end
        self.lock = threading.Lock()
        self.completed = 0
        self.errors: collections.Counter[str] = collections.Counter()
        self.live = in_flight
        self.drained = threading.Event()

    def launch(self) -> None:
        try:
            self._call()
        except ShmBrokerError as exc:  # no live worker, client closed: this chain ends here
            with self.lock:
                self.errors[f"submit:{exc.code}"] += 1
            self._chain_ended()

    def _call(self) -> None:
        self.client.call(self.model, self.feeds, self.on_done)

    def on_done(self, _outputs: object, exc: ShmBrokerError | None) -> None:
        try:
            now = time.perf_counter()
            if self.t_count <= now < self.t_end:
                with self.lock:
                    if exc is None:
                        self.completed += 1
                    else:
                        self.errors[getattr(exc, "code", type(exc).__name__)] += 1
            if now < self.t_end:
                self.launch()
            else:
                self._chain_ended()
        except BaseException:
            self._chain_ended()
            raise

    def _chain_ended(self) -> None:
        with self.lock:
            self.live -= 1
            if self.live <= 0:
                self.drained.set()


class _TimedChains(_Chains):
    """``_Chains`` that also keep each successful in-window request's submit-to-completion time (ns).

    The time runs from just before ``Client.call`` (input copy included) to the start of the callback.
    ``samples`` is appended to only by callbacks, and ``list.append`` is atomic, so it needs no lock.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.samples: list[int] = []
        self.count_ns = int(self.t_count * 1e9)
        self.end_ns = int(self.t_end * 1e9)

    def _call(self) -> None:
        t0 = time.perf_counter_ns()
        self.client.call(self.model, self.feeds, lambda out, exc: self._timed_done(t0, out, exc))

    def _timed_done(self, t0: int, outputs: object, exc: ShmBrokerError | None) -> None:
        t1 = time.perf_counter_ns()
        if exc is None and self.count_ns <= t1 < self.end_ns:
            self.samples.append(t1 - t0)
        self.on_done(outputs, exc)


def _window(c: Client, model: str, feeds: dict[str, np.ndarray], in_flight: int, warmup_s: float,
            duration_s: float, timed: bool) -> Figures:
    """From now: ``in_flight`` chains, ``warmup_s`` uncounted, a window of ``duration_s``, then drain."""
    timeout_s = c.models[model].info.timeout_ms / 1e3
    t0 = time.perf_counter()
    kind = _TimedChains if timed else _Chains
    chains = kind(c, model, feeds, t0 + warmup_s, t0 + warmup_s + duration_s, in_flight)
    for _ in range(in_flight):
        chains.launch()
    drained = chains.drained.wait(chains.t_end - time.perf_counter() + timeout_s + 10.0)
    with chains.lock:
        completed, errors, live = chains.completed, dict(chains.errors), chains.live
    return {
        "completed": completed,
        "errors": sum(errors.values()),
        "error_codes": errors,
        "window_s": duration_s,
        "lost": 0 if drained else live,
        **({"latency_ns": np.asarray(chains.samples, dtype=np.int64)} if isinstance(chains, _TimedChains) else {}),
    }


def throughput_client(spec: dict[str, Any], sync: Sync) -> Figures:
    """Keep ``in_flight`` requests of ``rows`` items outstanding; count completions in the window."""
    model: str = spec["model"]
    in_flight: int = spec["in_flight"]
    with Client(spec["runtime_dir"], slots=2 * in_flight, name=f"bench-{spec['index']}") as c:
        feeds = _inputs(c, model, spec.get("rows", 1), spec["seed"])
        for _ in range(spec["warmup_requests"]):
            c.infer(model, feeds)
        sync()
        return _window(c, model, feeds, in_flight, spec["warmup_s"], spec["duration_s"], timed=False)


def sweep_client(spec: dict[str, Any], sync: Sync) -> Figures:
    """The concurrency sweep's client: one window per entry of ``spec["rounds"]`` (requests in flight in
    that round; 0: sit it out), every request timed.

    Each round starts on ``spec["round_barrier"]`` (all sweep processes and the bench), so that a round
    starts only once every process has drained the previous one; a process that fails aborts it. Returns
    ``{"rounds": [window figures with latency_ns, or None for a round sat out]}``.
    """
    model: str = spec["model"]
    rounds: list[int] = spec["rounds"]
    barrier = spec["round_barrier"]
    with Client(spec["runtime_dir"], slots=2 * max(rounds), name=f"bench-sweep-{spec['index']}") as c:
        feeds = _inputs(c, model, spec.get("rows", 1), spec["seed"])
        for _ in range(spec["warmup_requests"]):
            c.infer(model, feeds)
        sync()
        out: list[Figures | None] = []
        try:
            for n in rounds:
                barrier.wait(spec["round_timeout_s"])
                out.append(_window(c, model, feeds, n, spec["warmup_s"], spec["duration_s"], timed=True) if n
                           else None)
            barrier.wait(spec["round_timeout_s"])  # the last round's end, for the bench's server counters
        except BaseException:
            barrier.abort()
            raise
    return {"rounds": out}
