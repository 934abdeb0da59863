"""broker.ops.probe and prober_process: the health probes run in a child process of the broker, so that
``shmbroker serve`` (and a worker in thread mode) never loads the client library; a killed prober process is
started again and its probes pass again."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from tests.conftest import CLI, REPO, TEST_MODELS, free_port, write_config

# `shmbroker serve` as the CLI runs it, writing the names of the modules it loaded to a file at its exit
SERVE_AND_LIST = """
import atexit, runpy, sys
out = sys.argv.pop(1)
atexit.register(lambda: open(out, "w").write("\\n".join(sorted(sys.modules))))
sys.argv[0] = "shmbroker"
runpy.run_module("shmbroker.broker.cli", run_name="__main__")
"""


def _ready(port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health/ready?wait=90", timeout=120) as r:
        return int(r.status)


def _passed(port: int, model: str) -> int:
    """The probes of ``model`` that passed, from /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60) as r:
        text = r.read().decode()
    m = re.search(rf'^shmbroker_health_probes_total{{model="{model}",result="ok"}} (\S+)$', text, re.M)
    assert m, text
    return int(float(m.group(1)))


def _prober(serve: subprocess.Popen[bytes]) -> psutil.Process:
    (p,) = [c for c in psutil.Process(serve.pid).children() if c.name() == "shmb-prober"]
    return p


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_serve_probes_from_a_child_and_loads_no_client_module(tmp_path: Path, mode: str) -> None:
    port = free_port()
    probes = "probe_interval_ms = 200\nprobe_timeout_ms = 5000\nready_max_age_ms = 30000\n"
    cfg = write_config(tmp_path / "broker.toml", mode,
                       models=TEST_MODELS + f"\n[monitoring]\nhttp_port = {port}\n{probes}")
    listed = tmp_path / "modules.txt"
    env = dict(os.environ, SHMBROKER_RUNTIME_DIR=str(tmp_path / "run"))
    with open(tmp_path / "broker.log", "wb") as log:
        serve = subprocess.Popen([sys.executable, "-c", SERVE_AND_LIST, str(listed), "serve", "--config", str(cfg)],
                                 env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    try:
        subprocess.run([*CLI, "health", "--wait", "90"], env=env, check=True, capture_output=True)
        assert _ready(port) == 200  # every model's probe passed, through the child's session
        first = _prober(serve)
        before = _passed(port, "tiny")
        first.kill()
        first.wait(30)
        deadline = time.monotonic() + 90
        while _passed(port, "tiny") <= before + 1:  # a new prober process passes the probes again
            assert time.monotonic() < deadline, "no probe passed after the prober process was killed"
            time.sleep(0.1)
        assert _prober(serve).pid != first.pid
    finally:
        serve.send_signal(signal.SIGTERM)
        rc = serve.wait(60)
    assert rc == 0, (tmp_path / "broker.log").read_text()
    modules = listed.read_text().split()
    assert "shmbroker.broker.serving.service" in modules  # the list is the broker's own
    client = [m for m in modules if m == "shmbroker.client" or m.startswith("shmbroker.client.")]
    assert not client, f"serve loaded the client library: {client}"
