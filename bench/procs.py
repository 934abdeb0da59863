"""Client processes for a phase: spawned, started together on a Barrier, each reporting one result dict.

A child does its set-up (connect, warm up) first, then waits on the barrier with the other children and the
bench process, so the measured windows of all children start together. A child that fails before the barrier
aborts it, so nobody waits for a start that will not come.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import queue
import signal
import subprocess
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from multiprocessing.context import SpawnContext, SpawnProcess
from typing import Any

import psutil

from shmbroker.bench.common import BenchError, Figures, Progress
from shmbroker.broker.common import proc

SETUP_TIMEOUT_S = 120.0  # connect + warm up, per phase
Sync = Callable[[], None]
Target = Callable[[dict[str, Any], Sync], Figures]


def spawn_context() -> SpawnContext:
    return mp.get_context("spawn")


def child_setup() -> None:
    """In a spawned child: leave Ctrl-C to the bench process (it ends the children), die with the bench."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    proc.die_with_parent(signal.SIGTERM)


def _child(target: Target, index: int, spec: dict[str, Any], barrier: threading.Barrier,
           results: mp.Queue[tuple[int, bool, Any]]) -> None:
    def sync() -> None:
        barrier.wait(SETUP_TIMEOUT_S)

    child_setup()
    proc.name_process(f"shmb-bench-{index}")  # py-spy and top find a client by this name
    try:
        out = target(spec, sync)
    except BaseException as exc:
        barrier.abort()
        results.put((index, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        raise
    results.put((index, True, out))


def run_group(progress: Progress, target: Target, specs: list[dict[str, Any]],
              expect_s: float | None) -> list[Figures]:
    """Run ``target(spec, sync)`` in one spawned process per spec; return their results in spec order.

    ``expect_s`` is how long the measured part should take after the barrier (None: a count of requests,
    not a time); the wait gives up (and kills the children) well after it.
    """
    ctx = spawn_context()
    barrier = ctx.Barrier(len(specs) + 1)
    results: mp.Queue[tuple[int, bool, Any]] = ctx.Queue()
    procs: list[SpawnProcess] = [
        ctx.Process(target=_child, args=(target, i, spec, barrier, results), name=f"shmb-bench-{i}", daemon=True)
        for i, spec in enumerate(specs)
    ]
    out: dict[int, Figures] = {}
    errors: list[str] = []
    try:
        for p in procs:
            p.start()
        try:
            barrier.wait(SETUP_TIMEOUT_S)
        except threading.BrokenBarrierError:
            _collect(results, out, errors, procs, deadline=time.monotonic() + 5.0)
            detail = "\n".join(errors or ["(no message)"])
            raise BenchError(f"a client process failed during set-up:\n{detail}") from None
        t_start = time.monotonic()
        deadline = t_start + (expect_s if expect_s is not None else 240.0) + 60.0
        next_tick = t_start + 2.0
        while len(out) + len(errors) < len(specs):
            now = time.monotonic()
            if now > deadline:
                raise BenchError(f"client processes still running {now - t_start:.0f} s after the start")
            if now >= next_tick:
                since = now - t_start
                if expect_s is None:
                    progress.tick(f"{since:.1f} s since the start signal")
                else:
                    progress.tick(f"{since:.1f} s since the start signal (window ~{expect_s:.1f} s"
                                  f"{'; draining the last requests' if since > expect_s else ''})")
                next_tick = now + 2.0
            try:
                item = results.get(timeout=0.25)
            except queue.Empty:
                if all(not p.is_alive() for p in procs) and results.empty():
                    missing = sorted(set(range(len(specs))) - set(out))
                    codes = [procs[i].exitcode for i in missing]
                    raise BenchError(f"client processes {missing} exited (codes {codes}) without a result") from None
                continue
            _record(item, out, errors)
        if errors:
            raise BenchError("a client process failed:\n" + "\n".join(errors))
        for p in procs:
            p.join(10.0)
        return [out[i] for i in range(len(specs))]
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(5.0)
        results.close()
        results.join_thread()


def _record(item: tuple[int, bool, Any], out: dict[int, Figures], errors: list[str]) -> None:
    index, ok, payload = item
    if ok:
        out[index] = payload
    else:
        errors.append(f"process {index}: {payload}")


def _collect(results: mp.Queue[tuple[int, bool, Any]], out: dict[int, Figures], errors: list[str],
             procs: list[SpawnProcess], deadline: float) -> None:
    """Gather what the children reported before a failure, waiting until ``deadline`` at most."""
    while time.monotonic() < deadline:
        try:
            _record(results.get(timeout=0.2), out, errors)
        except queue.Empty:
            if all(not p.is_alive() for p in procs):
                with contextlib.suppress(queue.Empty):
                    while True:
                        _record(results.get_nowait(), out, errors)
                return


def tree_cpu_s(roots: Iterable[int], cache: dict[int, psutil.Process] | None = None) -> float:
    """User + system CPU seconds of the processes ``roots`` and all their descendants alive now; ``cache`` keeps
    the Process objects of a sampler that asks often."""
    cache = {} if cache is None else cache
    total = 0.0
    for root in roots:
        try:
            procs = [psutil.Process(root)]
            procs += procs[0].children(recursive=True)
        except psutil.Error:
            continue
        for p in procs:
            q = cache.setdefault(p.pid, p)
            try:
                t = q.cpu_times()
            except psutil.Error:
                continue
            total += t.user + t.system
    return total


def wait_or_kill(proc: subprocess.Popen[Any], timeout_s: float) -> bool:
    """Wait up to ``timeout_s`` for a process told to stop, else SIGKILL it and reap it; whether it was killed."""
    try:
        proc.wait(timeout_s)
        return False
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10.0)
        return True
