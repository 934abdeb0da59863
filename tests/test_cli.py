"""The ``shmbroker`` query commands against live brokers: ``infer`` compared with onnxruntime on the same image,
``health --wait`` and ``models --wait`` across a broker's start and restart (real ``serve`` processes)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import CLI, REPO, TEST_MODELS, RunningBroker, launch_broker

TINY_ONLY = TEST_MODELS.split("[models.nsfw]")[0]


def _query(runtime_dir: Path, *argv: str) -> subprocess.Popen[str]:
    """``shmbroker ARGV`` in a child, started now, asking the broker of ``runtime_dir``."""
    env = dict(os.environ, SHMBROKER_RUNTIME_DIR=str(runtime_dir))
    return subprocess.Popen([*CLI, *argv], env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _finish(p: subprocess.Popen[str], b: RunningBroker) -> tuple[int, str, str]:
    out, err = p.communicate(timeout=150)
    assert p.returncode == 0, f"{p.args!r}: exit {p.returncode}: {err}\nbroker log:\n{b.log()}"
    return p.returncode, out, err


def test_wait_covers_a_broker_that_is_starting(tmp_path: Path) -> None:
    """The README's sequence: `shmbroker serve &`, then at once `health --wait` and `models --wait`."""
    b = launch_broker(tmp_path, models=TINY_ONLY)
    try:
        health = _query(b.runtime_dir, "health", "--wait", "120")
        models = _query(b.runtime_dir, "models", "--wait", "120")
        assert "tiny: ready" in _finish(health, b)[1]
        assert _finish(models, b)[1].startswith("tiny (max_batch 16")
    finally:
        assert b.stop() == 0, b.log()


def test_health_wait_covers_a_broker_restart(tmp_path: Path) -> None:
    """A broker killed (its socket file left, refusing), then a new one on the same directory: the waiting
    `health --wait` answers from the new one."""
    a = launch_broker(tmp_path, models=TINY_ONLY, name="a")
    assert a.health(wait_s=90).ready, a.log()
    a.proc.send_signal(signal.SIGKILL)
    a.proc.wait(30)
    assert (a.runtime_dir / "broker.sock").exists()  # left behind: connections to it are refused
    health = _query(a.runtime_dir, "health", "--wait", "120")
    b = launch_broker(tmp_path, models=TINY_ONLY, name="b")
    try:
        assert "tiny: ready" in _finish(health, b)[1]
    finally:
        assert b.stop() == 0, b.log()


@pytest.mark.parametrize("command", ["health", "models"])
def test_wait_without_a_broker_names_the_reason_and_the_setting_at_its_deadline(command: str,
                                                                                  tmp_path: Path) -> None:
    t0 = time.monotonic()
    p = _query(tmp_path, command, "--wait", "1")
    _out, err = p.communicate(timeout=60)
    assert p.returncode == 2, err
    assert time.monotonic() - t0 >= 1.0, err  # it waited to its deadline
    assert f"no broker answered on the runtime directory {tmp_path} (from $SHMBROKER_RUNTIME_DIR) within " \
           f"--wait 1 s: {tmp_path / 'broker.sock'} does not exist" in err, err


def test_a_command_whose_extra_is_missing_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from shmbroker.broker import cli

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "aiohttp" else real(name, *a))
    with pytest.raises(cli.CliError, match=r"`shmbroker http` needs the \[http\] extra, .*no aiohttp.*"
                                           r"pip install 'shmbroker\[http\]'"):
        cli.require_extra("http")
    cli.require_extra("serve")  # this checkout has the rest
    cli.require_extra("health")  # a query command needs only the base install
