"""systemd's notify protocol against a real NOTIFY_SOCKET that the test opens, as systemd would for Type=notify;
the units pass `systemd-analyze verify` and their command lines parse with the CLI's own parser."""

from __future__ import annotations

import configparser
import os
import shlex
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from shmbroker.broker.common import protocol as P
from shmbroker.broker.common.ask import ask_broker
from shmbroker.broker.ops.notify import Notifier
from tests.conftest import CLI, REPO, fifo_model, free_port, release_fifo_model, write_config

WATCHDOG_USEC = 400_000  # pings expected every 0.2 s
SO_PASSCRED = getattr(socket, "SO_PASSCRED", 16)
SCM_CREDENTIALS = getattr(socket, "SCM_CREDENTIALS", 2)
CREDS = struct.Struct("iII")  # struct ucred: pid, uid, gid


def http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            status: int = r.status
            return status
    except urllib.error.HTTPError as exc:
        return exc.code


class NotifySocket:
    """The receiving end systemd would hold: each datagram with the sender's pid (SCM_CREDENTIALS)."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.setsockopt(socket.SOL_SOCKET, SO_PASSCRED, 1)

    def recv(self, timeout: float) -> tuple[dict[str, str], int, float]:
        """(fields, sender pid, arrival time); raises TimeoutError when nothing comes."""
        self.sock.settimeout(timeout)
        data, anc, _flags, _addr = self.sock.recvmsg(4096, socket.CMSG_SPACE(CREDS.size))
        pid = -1
        for level, kind, payload in anc:
            if level == socket.SOL_SOCKET and kind == SCM_CREDENTIALS:
                pid = CREDS.unpack(payload[: CREDS.size])[0]
        fields = dict(line.split("=", 1) for line in data.decode().splitlines())
        return fields, pid, time.monotonic()

    def until(self, key: str, timeout: float, seen: list[dict[str, str]]) -> tuple[dict[str, str], int, float]:
        end = time.monotonic() + timeout
        while True:
            msg = self.recv(max(0.1, end - time.monotonic()))
            seen.append(msg[0])
            if key in msg[0]:
                return msg


def test_ready_after_warmup_watchdog_at_rate_and_stopping_on_sigterm(tmp_path: Path) -> None:
    notify = NotifySocket(tmp_path / "notify.sock")
    port = free_port()
    runtime_dir = tmp_path / "run"
    cfg = write_config(tmp_path / "broker.toml", "process",
                       extra=f"[monitoring]\nhttp_port = {port}\nprobe_interval_ms = 1000\n")
    env = dict(os.environ, SHMBROKER_RUNTIME_DIR=str(runtime_dir), NOTIFY_SOCKET=str(tmp_path / "notify.sock"),
               WATCHDOG_USEC=str(WATCHDOG_USEC))
    proc = subprocess.Popen([*CLI, "serve", "--config", str(cfg)], env=env, cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        before: list[dict[str, str]] = []
        fields, pid, _t = notify.until("READY", 120, before)
        # at the moment READY=1 arrives every model has passed warm-up and a probe through the data path
        health = ask_broker(runtime_dir, P.Health(0), 10)
        assert isinstance(health, P.HealthReply) and health.ready, health
        # what a unit ordered After= this one (or its ExecStartPost=) runs: systemd starts it on READY=1
        after_unit = subprocess.run([*CLI, "health"], env=dict(os.environ, SHMBROKER_RUNTIME_DIR=str(runtime_dir)),
                                    cwd=REPO, capture_output=True, text=True, check=False, timeout=60)
        assert after_unit.returncode == 0, after_unit.stderr
        assert http_status(f"http://127.0.0.1:{port}/health/ready") == 200
        assert pid == proc.pid and fields["READY"] == "1" and fields["STATUS"].startswith("ready")
        assert any(m.get("STATUS", "").startswith("starting") for m in before), before

        pings: list[float] = []
        after: list[dict[str, str]] = []
        while len(pings) < 12:
            fields, pid, t = notify.until("WATCHDOG", 10, after)
            assert pid == proc.pid, "only the broker (the unit's main process) may ping"
            pings.append(t)
        rate = (len(pings) - 1) / (pings[-1] - pings[0])
        assert 1.5 <= rate <= 10, f"{rate:.1f} WATCHDOG=1 per second, expected about {2e6 / WATCHDOG_USEC:.0f}"
        assert not any("READY" in m for m in after), "READY=1 is sent once"

        proc.send_signal(signal.SIGTERM)
        fields, pid, _t = notify.until("STOPPING", 30, after)
        assert pid == proc.pid and fields["STOPPING"] == "1"
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        notify.sock.close()


def test_each_step_of_a_start_extends_systemds_start_timeout_and_shows_in_status(tmp_path: Path) -> None:
    """A first start may outlast TimeoutStartSec while it makes progress: each worker step asks for the step's
    deadline (broker.worker_start_timeout_ms) and a margin more, and STATUS= names the step."""
    notify = NotifySocket(tmp_path / "notify.sock")
    fifo, models = fifo_model(tmp_path)
    cfg = write_config(tmp_path / "broker.toml", "process", "worker_start_timeout_ms = 60000", models=models)
    env = dict(os.environ, SHMBROKER_RUNTIME_DIR=str(tmp_path / "run"), NOTIFY_SOCKET=str(tmp_path / "notify.sock"))
    proc = subprocess.Popen([*CLI, "serve", "--config", str(cfg)], env=env, cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        seen: list[dict[str, str]] = []
        fields, pid, _t = notify.until("EXTEND_TIMEOUT_USEC", 60, seen)
        assert pid == proc.pid and fields["EXTEND_TIMEOUT_USEC"] == str(70_000_000), fields
        while "loading its onnxruntime engine" not in fields.get("STATUS", ""):  # the worker is held there
            fields, _pid, _t = notify.recv(60)
            seen.append(fields)
        assert fields["STATUS"].startswith("starting: models not ready: slow (worker 0 starting for "), fields
        release_fifo_model(fifo)
        fields, _pid, _t = notify.until("READY", 60, seen)
        assert fields["STATUS"].startswith("ready"), fields
        assert sum("EXTEND_TIMEOUT_USEC" in m for m in seen) == 3, seen  # loading, building, warming up
    finally:
        proc.send_signal(signal.SIGTERM)
        if proc.wait(30) != 0:
            proc.kill()
        notify.sock.close()


def test_watchdog_for_another_pid_and_no_socket_send_nothing(tmp_path: Path) -> None:
    env = {"NOTIFY_SOCKET": str(tmp_path / "none.sock"), "WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "1"}
    n = Notifier.from_env(env)
    assert n.watchdog_interval is None, "WATCHDOG_PID names another process: its watchdog is not ours"
    assert env == {}, "the variables are removed so worker processes do not inherit them"
    n.ready("x")  # no listener: logged once, never raised
    n.close()
    assert not Notifier.from_env({}).enabled


@pytest.mark.parametrize("address", ["@shmb-test-{pid}", "{tmp}/n.sock"])
def test_abstract_and_path_sockets(tmp_path: Path, address: str) -> None:
    addr = address.format(pid=os.getpid(), tmp=tmp_path)
    rx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    rx.bind("\0" + addr[1:] if addr.startswith("@") else addr)
    rx.settimeout(10)
    n = Notifier.from_env({"NOTIFY_SOCKET": addr, "WATCHDOG_USEC": "2000000"})
    assert n.watchdog_interval == 1.0
    n.ping(100.0)
    n.ping(100.5)  # within half the period: no datagram
    n.ping(101.0)
    n.stopping()
    got = [rx.recv(4096).decode() for _ in range(3)]
    assert got[:2] == ["WATCHDOG=1", "WATCHDOG=1"] and got[2].startswith("STOPPING=1\nSTATUS=")
    n.close()
    rx.close()


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze (.ci/run installs it)")
def test_units_pass_systemd_analyze_verify() -> None:
    r = subprocess.run(["bash", str(REPO / "systemd" / "verify.sh")], capture_output=True, text=True, check=False,
                       timeout=120, env=dict(os.environ, SHMBROKER_BIN=str(Path(sys.executable).parent / "shmbroker")))
    assert r.returncode == 0, r.stderr
    assert "shmbroker.service: ok" in r.stdout and "shmbroker-http.service: ok" in r.stdout, r.stdout


@pytest.mark.parametrize("unit", sorted(p.name for p in (REPO / "systemd").glob("*.service")))
def test_each_units_command_line_is_one_the_cli_takes(unit: str) -> None:
    """A unit's ExecStart, split as systemd splits it, parses with `shmbroker`'s own parser: no option in a
    unit is one the command has renamed or dropped."""
    from shmbroker.broker.cli import build_parser

    cfg = configparser.ConfigParser(strict=False, interpolation=None)
    cfg.read(REPO / "systemd" / unit)
    argv = shlex.split(cfg["Service"]["ExecStart"])
    assert argv[0] == "/usr/local/bin/shmbroker"
    args = build_parser().parse_args(argv[1:])  # SystemExit (exit 2, the option named) on an unknown option
    assert callable(args.fn)


def test_each_units_documentation_is_a_file_the_install_steps_put_there() -> None:
    """Every ``Documentation=`` of a unit names a file that DEPLOY.md's install steps install from the package,
    which the wheel carries: the unit's documentation is on the box, network or not."""
    import fnmatch
    import re
    import tomllib

    import shmbroker

    deploy = (REPO / "docs" / "DEPLOY.md").read_text()
    shipped = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["shmbroker"]
    package = Path(shmbroker.__file__).parent
    for unit in sorted((REPO / "systemd").glob("*.service")):
        cfg = configparser.ConfigParser(strict=False, interpolation=None)
        cfg.read(unit)
        uris = cfg["Unit"].get("Documentation", "").split()
        assert uris, f"{unit.name}: no Documentation="
        for uri in uris:
            assert uri.startswith("file:/"), f"{unit.name}: {uri} is not a file on the box (man:, http:...)"
            dest = uri.removeprefix("file:")
            m = re.search(r'^install .*"\$pkg/(\S+)" ' + re.escape(dest) + r"\s", deploy, re.MULTILINE)
            assert m, f"{unit.name}: DEPLOY.md's install steps do not install {dest} from the package"
            source = m.group(1)
            assert (package / source).is_file(), source
            assert any(fnmatch.fnmatch(source, g) for g in shipped), f"the wheel does not carry {source}"
