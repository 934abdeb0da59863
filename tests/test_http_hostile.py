"""Slow, many and unauthorised clients of the HTTP front-end (`shmbroker http`), with real processes: a broker, the
front-end, and raw sockets that trickle headers, stall bodies or hold connections. Each is answered (408 or 503)
and closed, the front-end keeps serving, and its memory stays within --body-memory-mib; with --api-key-file only
callers that send the key are served."""

from __future__ import annotations

import http.client
import json
import os
import re
import resource
import secrets
import select
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import psutil
import pytest
import tritonclient.http as th
from tritonclient.utils import InferenceServerException

from shmbroker.frontend.settings import OWN_FDS
from tests.conftest import CLI, REPO, RunningBroker, running_broker
from tests.frontends import Front, start_frontend
from tests.models import direct

MIB = 1 << 20
INFER = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 256], "data": [1.0] * 256}]}).encode()
SLOW_HEAD = b"GET /v2/health/live HTTP/1.1\r\nHost: shmbroker\r\nX-Slow: "  # never finished
MARGIN_S = 30.0  # what a loaded machine may add to a timeout before the front-end acts on it


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningBroker]:
    with running_broker(tmp_path_factory.mktemp("http-hostile")) as b:
        yield b


def _stop(f: Front) -> None:
    f.proc.terminate()
    assert f.proc.wait(60) == 0, f.log_path.read_text()[-4000:]


def _front(broker: RunningBroker, tmp: Path, *extra: str) -> Front:
    """One front-end process with ``extra`` options."""
    return start_frontend(broker, tmp / "http.log", workers=1, extra=extra)


def _child(f: Front) -> psutil.Process:
    """The one front-end process, as it names itself in its answers."""
    status, headers, _body = f.raw("GET", "/v2/health/live")
    assert status == 200
    return psutil.Process(int(headers["X-Shmbroker-Frontend-Pid"]))


def _peak_rss(pid: int) -> int:
    """The process's peak resident memory (VmHWM), in bytes."""
    status = Path(f"/proc/{pid}/status").read_text()
    m = re.search(r"^VmHWM:\s+(\d+) kB", status, re.MULTILINE)
    assert m is not None, status
    return int(m.group(1)) * 1024


def _connect(f: Front) -> socket.socket:
    return socket.create_connection((f.host, f.port), timeout=60)


def _response(sock: socket.socket, wait_s: float = 60.0) -> tuple[int, dict[str, str], bytes, bool]:
    """The one response that comes on ``sock`` within ``wait_s``: (status, headers, body, closed after it)."""
    sock.settimeout(wait_s)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed after {data!r}, before a response"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    length = int(headers["content-length"])
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, "closed in the middle of a response"
        body += chunk
    closed = False
    if headers.get("connection", "").lower() == "close":
        rest = sock.recv(65536)
        assert rest == b"", f"bytes after a closing response: {rest[:200]!r}"
        closed = True
    return int(lines[0].split()[1]), headers, body[:length], closed


def _error(body: bytes) -> str:
    return str(json.loads(body)["error"])


def _post_head(length: int) -> bytes:
    return (f"POST /v2/models/tiny/infer HTTP/1.1\r\nHost: shmbroker\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


def test_slow_headers_are_answered_408_and_closed_and_idle_keep_alive_is_kept(broker: RunningBroker,
                                                                             tmp_path: Path) -> None:
    """--header-timeout 2: 20 connections trickling a header byte every 0.2 s are each answered 408, naming the
    option, and closed, no sooner than 2 s and within 2 s and a margin; so is a keep-alive connection that starts a
    second request and stalls. A keep-alive connection idle between requests is not timed out: it is served."""
    f = _front(broker, tmp_path, "--header-timeout", "2")
    try:
        idle = _connect(f)
        idle.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: shmbroker\r\n\r\n")
        assert _response(idle)[0] == 200
        again = _connect(f)
        again.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: shmbroker\r\n\r\n" + SLOW_HEAD)
        assert _response(again)[0] == 200
        slow = {_connect(f): time.monotonic() for _ in range(20)}
        for sock in slow:
            sock.sendall(SLOW_HEAD)
        slow[again] = time.monotonic()
        answered: dict[socket.socket, float] = {}
        deadline = time.monotonic() + 2 + MARGIN_S
        while len(answered) < len(slow) and time.monotonic() < deadline:
            readable, _, _ = select.select([s for s in slow if s not in answered], [], [], 0.2)
            for sock in readable:
                answered[sock] = time.monotonic()
            for sock in slow:
                if sock not in answered:
                    sock.sendall(b"x")  # a byte at a time: progress that must not extend the deadline
        assert len(answered) == len(slow), f"{len(slow) - len(answered)} slow connections still open"
        for sock, start in slow.items():
            status, _headers, body, closed = _response(sock)
            assert (status, closed) == (408, True) and "--header-timeout" in _error(body), body
            assert answered[sock] - start >= 2 - 0.05  # never before its deadline
            sock.close()
        idle.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: shmbroker\r\n\r\n")  # idle past 2 s, still served
        assert _response(idle)[0] == 200
        idle.close()
    finally:
        _stop(f)


def test_connections_past_the_cap_displace_the_ones_still_sending_headers(broker: RunningBroker,
                                                                         tmp_path: Path) -> None:
    """--max-connections 40: 60 connections that never finish their headers. The 20 oldest are answered 503,
    naming the option, and closed; a legitimate request is then served (displacing one more); the process holds
    at most 40 client connections' descriptors throughout."""
    f = _front(broker, tmp_path, "--max-connections", "40", "--header-timeout", "600")
    try:
        child = _child(f)
        base = child.num_fds()
        slow = [_connect(f) for _ in range(60)]
        for sock in slow:
            sock.sendall(SLOW_HEAD)
        refused: list[socket.socket] = []
        deadline = time.monotonic() + MARGIN_S
        while len(refused) < 20 and time.monotonic() < deadline:
            readable, _, _ = select.select([s for s in slow if s not in refused], [], [], 0.5)
            refused.extend(readable)
        assert len(refused) == 20, f"{len(refused)} of 60 connections answered, expected the 20 past the cap"
        for sock in refused:
            status, _headers, body, closed = _response(sock)
            assert (status, closed) == (503, True) and "--max-connections" in _error(body), body
            sock.close()
        assert _fds_within(child, base + 40)
        status, _headers, body = f.raw("POST", "/v2/models/tiny/infer", INFER)
        assert status == 200, body
        assert _fds_within(child, base + 40)
        for sock in slow:
            sock.close()
    finally:
        _stop(f)


def _fds_within(child: psutil.Process, most: int) -> bool:
    """Whether the process's descriptors come down to ``most``: those it answered and closed go at once, or
    LINGER_S later."""
    deadline = time.monotonic() + MARGIN_S
    while child.num_fds() > most and time.monotonic() < deadline:
        time.sleep(0.05)
    return bool(child.num_fds() <= most)


def _infer_tiny(f: Front, x: np.ndarray) -> tuple[int, np.ndarray | bytes]:
    """One infer request of ``x`` on a fresh connection: (status, the scores, or the error body); status 0 when
    the connection was reset or closed before an answer."""
    body = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": list(x.shape),
                                   "data": x.ravel().tolist()}]}).encode()
    try:
        status, _headers, answer = f.raw("POST", "/v2/models/tiny/infer", body)
    except (ConnectionError, http.client.RemoteDisconnected) as exc:
        return 0, repr(exc).encode()
    if status != 200:
        return status, answer
    out = json.loads(answer)["outputs"][0]
    return status, np.asarray(out["data"], np.float32).reshape(out["shape"])


class Flood(threading.Thread):
    """Opens connections that send nothing, ``per_wave`` at a time, holding each wave until the next one; at
    most ``waves`` waves, fewer once stopped. ``opened`` counts them."""

    def __init__(self, f: Front, per_wave: int, waves: int) -> None:
        super().__init__(name="flood", daemon=True)
        self.address = (f.host, f.port)
        self.per_wave = per_wave
        self.waves = waves
        self.opened = 0
        self.progress = threading.Condition()
        self.stop = threading.Event()

    def run(self) -> None:
        held: list[socket.socket] = []
        try:
            for _ in range(self.waves):
                for sock in held:
                    sock.close()
                held = []
                for _ in range(self.per_wave):
                    if self.stop.is_set():
                        return
                    try:
                        held.append(socket.create_connection(self.address, timeout=60))
                    except OSError:
                        continue  # refused or reset: the front-end's to decide, counted all the same
                    finally:
                        with self.progress:
                            self.opened += 1
                            self.progress.notify_all()
        finally:
            for sock in held:
                sock.close()

    def wait_opened(self, count: int) -> None:
        with self.progress:
            assert self.progress.wait_for(lambda: self.opened >= count or not self.is_alive(), 60), self.opened


def test_a_flood_of_idle_connections_within_the_documented_descriptors_lets_requests_through(
        broker: RunningBroker, tmp_path: Path) -> None:
    """--max-connections 20 under the open-files limit docs/DEPLOY.md gives (N + 64): while another thread opens
    connections that send nothing, 300 at a time, 25 infer requests, each on a fresh connection and each sent
    once 12 more of those are open, are all answered 200 with the model's scores; the front-end logs no
    descriptor exhaustion and serves on."""
    n = 20
    f = start_frontend(broker, tmp_path / "http.log", workers=1, extra=("--max-connections", str(n)),
                       max_fds=n + OWN_FDS)
    flood = Flood(f, per_wave=300, waves=10)
    rng = np.random.default_rng(38)
    try:
        flood.start()
        results: list[int] = []
        for i in range(25):
            flood.wait_opened(12 * (i + 1))
            x = rng.standard_normal((1, 256), dtype=np.float32)
            status, y = _infer_tiny(f, x)
            results.append(status)
            if status == 200:
                assert isinstance(y, np.ndarray)
                np.testing.assert_allclose(y, direct("tiny", x), rtol=0, atol=1e-5)
        flood.stop.set()
        flood.join(60)
        assert results == [200] * 25, f"{results.count(200)} of 25 answered 200: {results}"
        assert f.raw("POST", "/v2/models/tiny/infer", INFER)[0] == 200
        log_text = f.log_path.read_text()
        assert "Too many open files" not in log_text and "EMFILE" not in log_text, log_text[-3000:]
    finally:
        flood.stop.set()
        _stop(f)


def _stall(f: Front, declared: int, sent: int) -> socket.socket:
    """A connection that sends an infer request's headers declaring ``declared`` body bytes, then ``sent`` of
    them, and stalls. Past the kernel's socket buffers, the send returning means the front-end read the body."""
    sock = _connect(f)
    sock.sendall(_post_head(declared) + b"[" * sent)
    return sock


def test_stalled_bodies_are_held_within_body_memory_then_answered_408(broker: RunningBroker, tmp_path: Path) -> None:
    """--body-memory-mib 128, --body-timeout 10: 10 connections each send 32 MiB of a declared 64 MiB body and
    stall. Two bodies fit: those two are answered 408, naming --body-timeout, and closed within 10 s and a margin;
    the other eight are answered 503 at once, naming --body-memory-mib, their bodies unread. The process's peak
    memory grows by less than the ten bodies' 320 MiB, and once the two are gone a request is served."""
    f = _front(broker, tmp_path, "--body-memory-mib", "128", "--body-timeout", "10", "--max-body-mib", "64")
    try:
        pid = _child(f).pid
        assert f.raw("POST", "/v2/models/tiny/infer", INFER)[0] == 200
        base = _peak_rss(pid)
        stalled = [_stall(f, 64 * MIB, 32 * MIB) for _ in range(10)]
        sent = time.monotonic()
        statuses: dict[int, list[str]] = {}
        for sock in stalled:
            status, _headers, body, closed = _response(sock, 10 + MARGIN_S)
            assert closed, (status, body)
            statuses.setdefault(status, []).append(_error(body))
            sock.close()
        assert time.monotonic() - sent < 10 + MARGIN_S
        assert sorted((k, len(v)) for k, v in statuses.items()) == [(408, 2), (503, 8)], statuses
        assert all("--body-timeout" in e for e in statuses[408]), statuses[408]
        assert all("--body-memory-mib 128" in e for e in statuses[503]), statuses[503]
        grown = _peak_rss(pid) - base
        assert grown < 256 * MIB, f"peak memory grew by {grown / MIB:.0f} MiB"
        status, _headers, body = f.raw("POST", "/v2/models/tiny/infer", INFER)
        assert status == 200, body
    finally:
        _stop(f)


def test_when_every_connection_is_answering_a_new_one_is_refused_503(broker: RunningBroker, tmp_path: Path) -> None:
    """--max-connections 2, both connections sending a body: a third connection is answered 503, naming the option,
    and closed; none of the two is displaced. Once they leave, requests are served again."""
    f = _front(broker, tmp_path, "--max-connections", "2", "--body-memory-mib", "128", "--body-timeout", "600")
    try:
        busy = [_stall(f, 64 * MIB, 32 * MIB) for _ in range(2)]  # both read by the front-end: answering
        third = _connect(f)
        third.sendall(_post_head(len(INFER)) + INFER)
        status, _headers, body, closed = _response(third)
        assert (status, closed) == (503, True) and "--max-connections" in _error(body), body
        for sock in busy:
            sock.setblocking(False)
            with pytest.raises(BlockingIOError):
                sock.recv(1)  # still open, nothing sent to it
            sock.close()
        deadline = time.monotonic() + MARGIN_S
        status, _headers, body = f.raw("POST", "/v2/models/tiny/infer", INFER)
        while status == 503 and time.monotonic() < deadline:  # until the front-end has seen the two leave
            time.sleep(0.05)
            status, _headers, body = f.raw("POST", "/v2/models/tiny/infer", INFER)
        assert status == 200, body
    finally:
        _stop(f)


def _chunked(body: bytes, piece: int = 4096) -> bytes:
    """An infer request whose body goes in chunks of ``piece`` bytes (no Content-Length)."""
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + piece]), body[i:i + piece])
                      for i in range(0, len(body), piece))
    return (b"POST /v2/models/tiny/infer HTTP/1.1\r\nHost: shmbroker\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n" + chunks + b"0\r\n\r\n")


def test_bodies_past_max_body_mib_are_413_declared_or_chunked(broker: RunningBroker, tmp_path: Path) -> None:
    """--max-body-mib 1: a declared 2 MiB body is answered 413 before it is sent, a chunked one once past 1 MiB,
    each naming the option; a chunked body within it is served."""
    f = _front(broker, tmp_path, "--max-body-mib", "1")
    try:
        sock = _connect(f)
        sock.sendall(_post_head(2 * MIB))
        status, _headers, body, closed = _response(sock)
        assert (status, closed) == (413, True) and "--max-body-mib" in _error(body), body
        sock.close()
        sock = _connect(f)
        sock.sendall(_chunked(INFER))
        status, _headers, body, _closed = _response(sock)
        assert status == 200, body
        sock.sendall(_chunked(b" " * (2 * MIB)))
        status, _headers, body, closed = _response(sock)
        assert (status, closed) == (413, True) and "--max-body-mib" in _error(body), body
        sock.close()
    finally:
        _stop(f)


def _key_file(tmp: Path, mode: int, key: str) -> Path:
    path = tmp / "api.key"
    path.write_text(key + "\n")
    path.chmod(mode)
    return path


def test_an_api_key_file_admits_only_callers_that_send_the_key(broker: RunningBroker, tmp_path: Path) -> None:
    """--api-key-file (0640): without 'Authorization: Bearer KEY', or with another key, every request but the health
    probes is answered 401 naming the header; tritonclient sending the key gets its scores."""
    key = secrets.token_hex(32)
    f = _front(broker, tmp_path, "--api-key-file", str(_key_file(tmp_path, 0o640, key)))
    try:
        for headers in ({}, {"Authorization": f"Bearer {secrets.token_hex(32)}"}, {"Authorization": key},
                        {"Authorization": f"Basic {key}"}):
            for method, path, body in [("POST", "/v2/models/tiny/infer", INFER), ("GET", "/v2/models/tiny", b""),
                                       ("GET", "/v2", b""), ("GET", "/v2/models/nope/ready", b"")]:
                status, got, answer = f.raw(method, path, body, headers)
                assert status == 401, (path, headers, answer)
                assert "Authorization: Bearer" in _error(answer) and got["WWW-Authenticate"].startswith("Bearer")
        assert f.raw("GET", "/v2/health/live")[0] == 200
        assert f.raw("GET", "/v2/health/ready")[0] == 200
        c = th.InferenceServerClient(f.url, network_timeout=60.0)
        with pytest.raises(InferenceServerException) as ei:
            c.get_model_metadata("tiny")
        assert str(ei.value.status()) == "401"
        auth = {"Authorization": f"Bearer {key}"}
        x = np.random.default_rng(9).standard_normal((2, 256), dtype=np.float32)
        i = th.InferInput("x", [2, 256], "FP32")
        i.set_data_from_numpy(x, binary_data=True)
        y = c.infer("tiny", [i], headers=auth).as_numpy("y")
        assert y is not None
        np.testing.assert_allclose(y, direct("tiny", x), rtol=0, atol=1e-5)
        assert c.get_model_metadata("tiny", headers=auth)["name"] == "tiny"
        c.close()
    finally:
        _stop(f)


def _http(*argv: str, limit: int | None = None) -> subprocess.CompletedProcess[str]:
    """``shmbroker http ARGV`` that must fail before it serves (no broker needed); ``limit``: its open-files limit."""
    def lower() -> None:
        if limit is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))

    env = dict(os.environ, SHMBROKER_RUNTIME_DIR="/nonexistent/shmbroker-run")
    return subprocess.run([*CLI, "http", "--port", "0", *argv], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=60, check=False, preexec_fn=lower)


@pytest.mark.parametrize("mode", [0o644, 0o604, 0o646], ids=oct)
def test_an_api_key_file_others_may_read_is_refused(tmp_path: Path, mode: int) -> None:
    path = _key_file(tmp_path, mode, secrets.token_hex(32))
    r = _http("--api-key-file", str(path))
    assert r.returncode == 2, r.stderr
    assert f"--api-key-file {path}" in r.stderr and f"mode {mode:04o}" in r.stderr and "chmod 640" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize(("argv", "named"), [
    (("--header-timeout", "0"), "--header-timeout: expected seconds above 0, got 0"),
    (("--header-timeout", "nan"), "--header-timeout: expected seconds above 0, got nan"),
    (("--body-timeout", "-1"), "--body-timeout: expected seconds above 0, got -1"),
    (("--max-connections", "0"), "--max-connections: expected a number of connections above 0, got 0"),
    (("--max-body-mib", "0"), "--max-body-mib: expected MiB above 0, got 0"),
    (("--body-memory-mib", "32"), "--body-memory-mib: expected at least --max-body-mib (64)"),
    (("--api-key-file", "/nonexistent/key"), "--api-key-file /nonexistent/key: cannot read it"),
    (("--header-timeout", "soon"), "argument --header-timeout: invalid float value: 'soon'"),
], ids=["header_timeout_0", "header_timeout_nan", "body_timeout_negative", "max_connections_0", "max_body_mib_0",
        "body_memory_below_max_body", "api_key_file_missing", "header_timeout_not_a_number"])
def test_a_bad_limit_is_refused_naming_its_option(argv: tuple[str, ...], named: str) -> None:
    r = _http(*argv)
    assert r.returncode == 2, r.stderr
    assert named in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_a_short_api_key_is_refused(tmp_path: Path) -> None:
    path = _key_file(tmp_path, 0o600, "secret")
    r = _http("--api-key-file", str(path))
    assert r.returncode == 2 and f"--api-key-file {path}: expected one key of at least 16" in r.stderr, r.stderr


def test_max_connections_past_the_open_files_limit_is_refused(tmp_path: Path) -> None:
    r = _http("--max-connections", "512", limit=256)
    assert r.returncode == 2, r.stderr
    assert "--max-connections 512" in r.stderr and "256" in r.stderr and "ulimit" in r.stderr, r.stderr
