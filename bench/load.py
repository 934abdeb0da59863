"""Client processes that load the broker: sequential ``infer`` for latency, ``call`` chains for throughput.

Throughput: each process keeps ``in_flight`` requests outstanding with ``Client.call``, the client's
callback API (no Future). A request's callback (run by the client's IO thread) submits the next one, so a
completion and the next submission cost no thread hand-off, and the client coalesces them into one
SUBMIT per worker. The session has ``2 * in_flight`` slots, as an application would give itself headroom.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

import numpy as np

from bench.common import BenchError, Figures, latency_summary
from bench.procs import Sync
from client import Client, ShmBrokerError


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
            self.client.call(self.model, self.feeds, self.on_done)
        except ShmBrokerError as exc:  # no live worker, client closed: this chain ends here
            with self.lock:
                self.errors[f"submit:{exc.code}"] += 1
            self._chain_ended()

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


def throughput_client(spec: dict[str, Any], sync: Sync) -> Figures:
    """Keep ``in_flight`` requests of ``rows`` items outstanding; count completions in the window."""
    model: str = spec["model"]
    in_flight: int = spec["in_flight"]
    with Client(spec["runtime_dir"], slots=2 * in_flight, name=f"bench-{spec['index']}") as c:
        feeds = _inputs(c, model, spec.get("rows", 1), spec["seed"])
        for _ in range(spec["warmup_requests"]):
            c.infer(model, feeds)
        timeout_s = c.models[model].info.timeout_ms / 1e3
        sync()
        t0 = time.perf_counter()
        chains = _Chains(c, model, feeds, t0 + spec["warmup_s"], t0 + spec["warmup_s"] + spec["duration_s"],
                         in_flight)
        for _ in range(in_flight):
            chains.launch()
        drained = chains.drained.wait(chains.t_end - time.perf_counter() + timeout_s + 10.0)
        with chains.lock:
            completed, errors, live = chains.completed, dict(chains.errors), chains.live
    return {
        "completed": completed,
        "errors": sum(errors.values()),
        "error_codes": errors,
        "window_s": spec["duration_s"],
        "lost": 0 if drained else live,
    }
