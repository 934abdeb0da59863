"""bench.folded sums py-spy's collapsed stacks; bench.cpu_sample samples threads' CPU and run-queue seconds by name
and turns them into microseconds per request."""

from __future__ import annotations

import os
import threading

from shmbroker.bench import cpu_sample, folded
from shmbroker.broker.common import proc

STACKS = """thread (1): runner;_loop (gpu_worker/pipeline.py:120);issue (gpu_worker/streams.py:115) 30
thread (1): runner;_loop (gpu_worker/pipeline.py:120) 10
thread (2): MainThread;_serve (gpu_worker/worker.py:114);_drain_data (gpu_worker/worker.py:186) 60
not a stack line
"""


def test_threads_and_functions_are_shares_of_all_samples() -> None:
    stacks = folded.parse(STACKS)
    assert [count for _, count in stacks] == [30, 10, 60]
    lines = folded.summarize(stacks, top=3).splitlines()
    assert lines[0] == "100 samples"
    assert lines[1].split() == ["60.0%", "thread", "(2):", "MainThread"]
    assert "   40.0%  pipeline.py:_loop" in lines  # inclusive: on the stack in 30 + 10 samples
    assert lines[-3:] == ["   60.0%  worker.py:_drain_data", "   30.0%  streams.py:issue",  # exclusive: on top
                          "   10.0%  pipeline.py:_loop"]


def test_cpu_per_request_by_thread_name() -> None:
    before = {"runner": 1.0, "io": 2.0}
    after = {"runner": 1.5, "io": 2.1, "new": 0.2}
    assert cpu_sample.per_request(before, after, 100_000) == {"runner": 5.0, "new": 2.0, "io": 1.0, "total": 8.0}
    assert cpu_sample.per_request(before, after, 0) == {}


def test_a_named_thread_is_sampled_under_its_name() -> None:
    started, finish = threading.Event(), threading.Event()

    def work() -> None:
        proc.name_thread("bench-probe")
        started.set()
        finish.wait(10)

    t = threading.Thread(target=work)
    t.start()
    try:
        started.wait(10)
        assert "bench-probe" in cpu_sample.threads(os.getpid())
        names = set(cpu_sample.threads(os.getpid()))
        assert set(cpu_sample.preemptions(os.getpid())) == names
        waits = cpu_sample.run_waits(os.getpid())  # empty on a kernel that keeps no run-queue delay
        assert not waits or set(waits) == names
    finally:
        finish.set()
        t.join()
    assert cpu_sample.threads(2**22 + 1) == {}  # no such process
