"""Load generators for the reliability tests: spawned client processes that count every request's fate.

Each process keeps ``in_flight`` requests outstanding with ``Client.call``, checks every answer against
ONNX Runtime run in the process itself, and at the end puts a ``Tally`` on the result queue. Every request
submitted ends as exactly one of: ok (right result), wrong (a result that differs), failed with a code (a
``ShmBrokerError``: its class name is counted), or hung (no outcome ``hung_after_s`` after it was sent).
"""

from __future__ import annotations

import functools
import multiprocessing as mp
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.sharedctypes import Synchronized
from multiprocessing.synchronize import Barrier, Event
from pathlib import Path
from typing import Any

import numpy as np

SPAWN = mp.get_context("spawn")
RETRY_PAUSE_S = 0.02
PACE_S = 0.002  # the open-loop sender's sleep step: fewer wake-ups than one per request


@dataclass
class Tally:
    submitted: int = 0
    ok: int = 0
    wrong: int = 0
    hung: int = 0
    failed: dict[str, int] = field(default_factory=dict)
    ok_after_mark: int = 0  # successes completed after the parent set ``mark`` (e.g. once a worker is back)
    latencies_us: list[float] = field(default_factory=list)  # of successful requests
    failed_latency_us: dict[str, list[float]] = field(default_factory=dict)  # per error class, from sending
    offered_per_s: float = 0.0

    @property
    def failed_total(self) -> int:
        return sum(self.failed.values())

    def add(self, other: Tally) -> None:
        self.submitted += other.submitted
        self.ok += other.ok
        self.wrong += other.wrong
        self.hung += other.hung
        self.ok_after_mark += other.ok_after_mark
        self.latencies_us.extend(other.latencies_us)
        self.offered_per_s += other.offered_per_s
        for k, v in other.failed.items():
            self.failed[k] = self.failed.get(k, 0) + v
        for k, lat in other.failed_latency_us.items():
            self.failed_latency_us.setdefault(k, []).extend(lat)


def assert_accounted(t: Tally) -> None:
    """Every request submitted ended once, as a right result or an error with a code: none hung, none got a
    wrong result."""
    assert t.submitted == t.ok + t.failed_total + t.wrong + t.hung, t
    assert t.hung == 0, t
    assert t.wrong == 0, t
    assert not any(k.startswith("unexpected") for k in t.failed), t.failed


@dataclass
class LoadSpec:
    runtime_dir: Path
    model: str = "tiny"
    in_flight: int = 4
    slots: int = 8
    timeout_s: float | None = None  # None: the model's default
    hung_after_s: float = 30.0
    rate_per_s: float = 0.0  # 0: closed loop (a new request as soon as one finishes); else paced, open loop
    seed: int = 0


def _inputs(model: str, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    shape = (1, 256) if model == "tiny" else (1, 224, 224, 3)
    return [rng.standard_normal(shape, dtype=np.float32) for _ in range(8)]


def run_load(spec: LoadSpec, stop: Event, started: Barrier, mark: Synchronized[float], out: Any) -> None:
    """The body of one client process (spawned): run until ``stop``, then drain and report a Tally.

    Requests go out with ``Client.call``: the answer is counted in the callback, on the client's IO thread,
    so the sender's own cost per request stays small (the senders share the cores with the worker).
    """
    from shmbroker.client import Client, ShmBrokerError
    from tests.models import direct

    xs = _inputs(spec.model, spec.seed)
    refs = [direct(spec.model, x) for x in xs]
    t = Tally()
    cond = threading.Condition()
    outstanding: dict[int, float] = {}  # request number -> when it was sent

    def on_done(n: int, k: int, y: Any, exc: ShmBrokerError | None) -> None:
        now = time.monotonic()
        with cond:
            sent = outstanding.pop(n, None)
            if sent is None:  # already counted hung: the run had ended
                return
            if exc is not None:
                name = type(exc).__name__
                t.failed[name] = t.failed.get(name, 0) + 1
                t.failed_latency_us.setdefault(name, []).append((now - sent) * 1e6)
            elif float(np.abs(y - refs[k]).max()) <= 1e-5:  # np.allclose costs the sender 8 x as much
                t.ok += 1
                t.latencies_us.append((now - sent) * 1e6)
                if mark.value and time.time() > mark.value:
                    t.ok_after_mark += 1
            else:
                t.wrong += 1
            cond.notify()

    with Client(spec.runtime_dir, slots=spec.slots) as c:
        c.infer(spec.model, xs[0])
        started.wait(120)
        t0 = time.monotonic()
        n = 0
        while not stop.is_set():
            if spec.rate_per_s:  # open loop: the offered rate does not bend to the server's speed
                ahead = n - (time.monotonic() - t0) * spec.rate_per_s  # requests sent before they were due
                if ahead >= 1:  # sleep in steps of a few ms and then send what fell due, as one burst
                    stop.wait(min(PACE_S, ahead / spec.rate_per_s))
                    continue
            with cond:
                if len(outstanding) >= spec.in_flight:
                    cond.wait(PACE_S)
                    continue
                outstanding[n] = time.monotonic()
            k = n % len(xs)
            t.submitted += 1
            try:
                c.call(spec.model, xs[k], functools.partial(on_done, n, k), timeout=spec.timeout_s)
            except ShmBrokerError as exc:  # e.g. WorkerDied while no worker serves the model
                on_done(n, k, None, exc)
                stop.wait(RETRY_PAUSE_S)  # what an application does: retry soon, without spinning a core
            n += 1
        t.offered_per_s = n / max(1e-9, time.monotonic() - t0)
        _drain(cond, outstanding, spec.hung_after_s)
        with cond:
            t.hung = len(outstanding)
            outstanding.clear()  # a late answer after this counts nowhere
    out.put(t)


def _drain(cond: threading.Condition, outstanding: dict[int, float], hung_after_s: float) -> None:
    """Wait until every request is answered or the youngest has been out ``hung_after_s``."""
    with cond:
        while outstanding:
            left = max(outstanding.values()) + hung_after_s - time.monotonic()
            if left <= 0:
                return
            cond.wait(left)


class LoadGroup:
    """``n`` client processes started together; ``finish()`` stops them and returns the summed Tally."""

    def __init__(self, specs: list[LoadSpec]) -> None:
        self.stop = SPAWN.Event()
        self.started = SPAWN.Barrier(len(specs) + 1)
        self.mark: Synchronized[float] = SPAWN.Value("d", 0.0)
        self.out: Any = SPAWN.Queue()
        self.procs = [SPAWN.Process(target=run_load, args=(s, self.stop, self.started, self.mark, self.out),
                                    daemon=True) for s in specs]
        for p in self.procs:
            p.start()
        self.started.wait(180)  # every process connected and answered its first request

    def finish(self, timeout: float = 120) -> Tally:
        self.stop.set()
        total = Tally()
        for _ in self.procs:
            total.add(self.out.get(timeout=timeout))
        for p in self.procs:
            p.join(timeout)
        return total

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()


def hold_requests(runtime_dir: Path, model: str, n: int, out: Any) -> None:
    """A client process that submits ``n`` requests, reports its segment name and waits to be killed."""
    from shmbroker.client import Client

    c = Client(runtime_dir, slots=n)
    x = _inputs(model, 0)[0]
    c.infer(model, x)
    futs = [c.submit(model, x) for _ in range(n)]
    out.put(c.segment.name)
    for f in futs:  # never returns before the parent's SIGKILL: requests stay in flight until then
        f.exception()
    time.sleep(3600)


def churn_sessions(runtime_dir: Path, stop: Event, out: Any) -> None:
    """Open a session, run one request, close it; again until ``stop``. Puts (sessions, errors) on ``out``."""
    from shmbroker.client import Client, ShmBrokerError

    x = _inputs("tiny", 1)[0]
    n = errors = 0
    while not stop.is_set():
        try:
            with Client(runtime_dir, slots=2) as c:
                c.infer("tiny", x)
            n += 1
        except ShmBrokerError:
            errors += 1
        stop.wait(0.2)
    out.put((n, errors))
