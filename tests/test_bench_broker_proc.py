"""bench.broker_proc: the bench's own broker, with a real broker and worker on the CPU."""

from __future__ import annotations

import os
from pathlib import Path

import psutil

from shmbroker.bench.broker_proc import BrokerProcess
from shmbroker.bench.common import Progress
from tests.conftest import TINY_MODELS, write_config


def test_renice_workers_sets_every_thread_of_every_worker(tmp_path: Path) -> None:
    """Linux keeps a nice value per thread: the worker's runner and IO threads, made before, must move too."""
    path = write_config(tmp_path / "broker.toml", models=TINY_MODELS)
    with BrokerProcess(path, tmp_path, Progress()) as b:
        assert b.proc is not None
        pids = b.renice_workers(7)
        assert pids and set(pids) == {c.pid for c in psutil.Process(b.proc.pid).children(recursive=True)}
        for pid in pids:
            threads = psutil.Process(pid).threads()
            assert len(threads) > 1
            assert {os.getpriority(os.PRIO_PROCESS, t.id) for t in threads} == {7}
        assert os.getpriority(os.PRIO_PROCESS, b.proc.pid) == os.getpriority(os.PRIO_PROCESS, os.getpid())
