"""Slow, many and unauthorised clients of the HTTP front-end (`shmbroker http`), with real processes: a broker, the
front-end, and raw sockets that trickle headers, stall bodies or hold connections. Each is answered (408 or 503)
and closed, the front-end keeps serving, and its memory stays within --body-memory-mib; with --api-key-file only
callers that send the key are served."""

from __future__ import annotations

import asyncio
import contextlib
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
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import psutil
import pytest
import tritonclient.http as th
from tritonclient.utils import InferenceServerException

from shmbroker.frontend.limits import peer_of
from shmbroker.frontend.settings import OWN_FDS, RATE_WINDOW_S
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


def _connect(f: Front, source: str = "") -> socket.socket:
    """A connection to the front-end, from the loopback address ``source`` if given (a peer of its own)."""
    return socket.create_connection((f.host, f.port), timeout=60, source_address=(source, 0) if source else None)


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
        try:
            rest = sock.recv(65536)
        except ConnectionResetError:  # closed with bytes of ours unread: the kernel resets after the answer
            rest = b""
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


def _stall(f: Front, declared: int, sent: int, source: str = "") -> socket.socket:
    """A connection (from ``source``) that sends an infer request's headers declaring ``declared`` body bytes,
    then ``sent`` of them, and stalls. Past the kernel's socket buffers, the send returning means the front-end
    read the body. A connection the front-end answered and closed meanwhile is returned all the same."""
    sock = _connect(f, source)
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # answered 503 mid-body: the answer waits
        sock.sendall(_post_head(declared) + b"[" * sent)
    return sock


def _answered(socks: list[socket.socket], count: int, wait_s: float) -> list[socket.socket]:
    """The first ``count`` of ``socks`` that an answer (or the end) comes on within ``wait_s``."""
    ready: list[socket.socket] = []
    deadline = time.monotonic() + wait_s
    while len(ready) < count and time.monotonic() < deadline:
        readable, _, _ = select.select([s for s in socks if s not in ready], [], [], 0.5)
        ready.extend(readable)
    assert len(ready) >= count, f"{len(ready)} of {len(socks)} connections answered, expected {count}"
    return ready[:count]


def _silent(sock: socket.socket) -> bool:
    """Whether nothing came on ``sock``: still open, unanswered."""
    readable, _, _ = select.select([sock], [], [], 0)
    return not readable


def test_stalled_bodies_are_charged_as_they_arrive_within_body_memory(broker: RunningBroker, tmp_path: Path) -> None:
    """--body-memory-mib 32, 10 peers each sending 10 MiB of a declared 16 MiB body, then stalling: the front-end
    holds what fits of what arrived. Exactly 3 bodies are held (30 MiB; 40 would pass the limit), the other 7 are
    answered 503 naming --body-memory-mib 32, and the process's peak memory grows by less than twice the limit
    (the 10 bodies are 100 MiB). Once the held ones leave, a request is served."""
    f = _front(broker, tmp_path, "--body-memory-mib", "32", "--max-body-mib", "16", "--min-body-rate", "0",
               "--body-timeout", "600")
    try:
        pid = _child(f).pid
        assert f.raw("POST", "/v2/models/tiny/infer", INFER)[0] == 200
        base = _peak_rss(pid)
        stalled = [_stall(f, 16 * MIB, 10 * MIB, source=f"127.0.0.{10 + i}") for i in range(10)]
        refused = _answered(stalled, 7, MARGIN_S)
        for sock in refused:
            status, _headers, body, closed = _response(sock)
            assert (status, closed) == (503, True) and "--body-memory-mib 32" in _error(body), body
        held = [sock for sock in stalled if sock not in refused]
        assert all(_silent(sock) for sock in held), "a held body was answered"
        grown = _peak_rss(pid) - base
        assert grown < 64 * MIB, f"peak memory grew by {grown / MIB:.0f} MiB"
        for sock in stalled:
            sock.close()
        deadline = time.monotonic() + MARGIN_S
        status, _headers, body = f.raw("POST", "/v2/models/tiny/infer", INFER)
        while status == 503 and time.monotonic() < deadline:  # until the front-end has seen the held ones leave
            time.sleep(0.05)
            status, _headers, body = f.raw("POST", "/v2/models/tiny/infer", INFER)
        assert status == 200, body
    finally:
        _stop(f)


def test_stalled_declared_bodies_of_one_peer_leave_the_budget_to_others(broker: RunningBroker,
                                                                        tmp_path: Path) -> None:
    """--body-memory-mib 64, --max-body-mib 8, the default --min-body-rate (64 KiB/s): one peer (127.0.0.2)
    declares 8 bodies of 8 MiB, the whole budget, sends 1 MiB of each and stalls, and trickles a ninth at 5
    KiB/s. Meanwhile another peer's requests are all answered 200 with the model's scores. The nine are answered
    408 naming --min-body-rate and closed, not before the 10 s a body may fall behind; then the first peer is
    served again."""
    f = _front(broker, tmp_path, "--body-memory-mib", "64", "--max-body-mib", "8")
    rng = np.random.default_rng(4)
    try:
        start = time.monotonic()
        slow = [_stall(f, 8 * MIB, MIB, source="127.0.0.2") for _ in range(8)]
        trickle = _stall(f, 8 * MIB, 1024, source="127.0.0.2")
        for _ in range(5):
            x = rng.standard_normal((1, 256), dtype=np.float32)
            status, y = _infer_tiny(f, x)
            assert status == 200, y
            assert isinstance(y, np.ndarray)
            np.testing.assert_allclose(y, direct("tiny", x), rtol=0, atol=1e-5)
        answered: dict[socket.socket, float] = {}
        socks = [*slow, trickle]
        deadline = time.monotonic() + 2 * RATE_WINDOW_S + MARGIN_S
        while len(answered) < len(socks) and time.monotonic() < deadline:
            readable, _, _ = select.select([s for s in socks if s not in answered], [], [], 0.2)
            for sock in readable:
                answered[sock] = time.monotonic()
            if trickle not in answered:
                trickle.sendall(b"[" * 1024)  # 5 KiB/s: progress, below the rate
        assert len(answered) == len(socks), f"{len(socks) - len(answered)} of {len(socks)} still unanswered"
        for sock in socks:
            status, _headers, body, closed = _response(sock)
            assert (status, closed) == (408, True) and "--min-body-rate" in _error(body), body
            assert answered[sock] - start >= RATE_WINDOW_S - 0.05  # never before its pace fell behind
            sock.close()
        assert f.raw("POST", "/v2/models/tiny/infer", INFER, source="127.0.0.2")[0] == 200
    finally:
        _stop(f)


def test_one_peer_holds_at_most_its_share_of_body_memory(broker: RunningBroker, tmp_path: Path) -> None:
    """--peer-body-memory-mib 16 of --body-memory-mib 64: 127.0.0.2 sends 6 MiB of 4 bodies and stalls; exactly 2
    are held (12 MiB; 18 would pass its share), the other 2 answered 503 naming the option. 127.0.0.3 does the
    same with 2 bodies, both held, and a third peer is served; once they leave, 127.0.0.2 is served too."""
    f = _front(broker, tmp_path, "--body-memory-mib", "64", "--max-body-mib", "8", "--peer-body-memory-mib", "16",
               "--min-body-rate", "0", "--body-timeout", "600")
    try:
        greedy = [_stall(f, 8 * MIB, 6 * MIB, source="127.0.0.2") for _ in range(4)]
        refused = _answered(greedy, 2, MARGIN_S)
        for sock in refused:
            status, _headers, body, closed = _response(sock)
            assert (status, closed) == (503, True), body
            assert "from 127.0.0.2" in _error(body) and "--peer-body-memory-mib 16" in _error(body), body
        other = [_stall(f, 8 * MIB, 6 * MIB, source="127.0.0.3") for _ in range(2)]
        status, _headers, body = f.raw("POST", "/v2/models/tiny/infer", INFER)
        assert status == 200, body
        assert all(_silent(sock) for sock in other), "a body of a peer within its share was answered"
        assert all(_silent(sock) for sock in greedy if sock not in refused), "a held body was answered"
        for sock in [*greedy, *other]:
            sock.close()
        deadline = time.monotonic() + MARGIN_S
        status, _headers, body = f.raw("POST", "/v2/models/tiny/infer", INFER, source="127.0.0.2")
        while status == 503 and time.monotonic() < deadline:  # until the front-end has seen the held ones leave
            time.sleep(0.05)
            status, _headers, body = f.raw("POST", "/v2/models/tiny/infer", INFER, source="127.0.0.2")
        assert status == 200, body
    finally:
        _stop(f)


def _peer_seen(listen: socket.socket, connect: Callable[[], socket.socket]) -> str:
    """``peer_of`` for the transport of a connection that ``connect`` makes to ``listen``."""
    async def seen() -> str:
        loop = asyncio.get_running_loop()
        got: asyncio.Future[str] = loop.create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                got.set_result(peer_of(transport))
                transport.close()

        server = await loop.create_server(Probe, sock=listen)
        client = await loop.run_in_executor(None, connect)
        try:
            return await asyncio.wait_for(got, 60)
        finally:
            client.close()
            server.close()

    return asyncio.run(seen())


@pytest.mark.parametrize("family", ["ipv4", "ipv6", "unix"])
def test_bodies_are_charged_to_an_address_an_ipv6_64_or_a_unix_uid(tmp_path: Path, family: str) -> None:
    """The peer a body is charged to: the client's IPv4 address, its IPv6 address's /64, or on a Unix socket its
    uid (SO_PEERCRED)."""
    if family == "ipv4":
        v4 = socket.create_server(("127.0.0.1", 0))
        assert _peer_seen(v4, lambda: socket.create_connection(v4.getsockname(), 60, ("127.0.0.2", 0))) == "127.0.0.2"
    elif family == "ipv6":
        if not Path("/proc/net/if_inet6").exists():
            pytest.skip("this machine has no IPv6")
        v6 = socket.create_server(("::1", 0), family=socket.AF_INET6)
        assert _peer_seen(v6, lambda: socket.create_connection(v6.getsockname()[:2], 60)) == "::/64"
    else:
        path = str(tmp_path / "peer.sock")
        unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        unix.bind(path)
        unix.listen()

        def by_unix() -> socket.socket:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(path)
            return sock

        assert _peer_seen(unix, by_unix) == f"uid {os.getuid()}"


def test_a_body_not_all_there_within_body_timeout_is_answered_408(broker: RunningBroker, tmp_path: Path) -> None:
    """--body-timeout 3, no --min-body-rate: a body that stalls is answered 408 naming --body-timeout and closed,
    not before 3 s."""
    f = _front(broker, tmp_path, "--body-timeout", "3", "--min-body-rate", "0")
    try:
        start = time.monotonic()
        sock = _stall(f, MIB, 1024)
        (done,) = _answered([sock], 1, 3 + MARGIN_S)
        assert time.monotonic() - start >= 3 - 0.05
        status, _headers, body, closed = _response(done)
        assert (status, closed) == (408, True) and "--body-timeout" in _error(body), body
        sock.close()
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
        while True:  # until the front-end has seen the two leave: till then it answers 503 and closes, maybe
            try:     # before it has read the request (the client's send then fails)
                status, _headers, body = f.raw("POST", "/v2/models/tiny/infer", INFER)
            except (BrokenPipeError, ConnectionResetError) as exc:
                status, body = 503, str(exc).encode()
            if status != 503 or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
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
    (("--peer-body-memory-mib", "32"), "--peer-body-memory-mib: expected --max-body-mib (64) to --body-memory-mib"),
    (("--peer-body-memory-mib", "1024"), "--peer-body-memory-mib: expected --max-body-mib (64) to --body-memory-mib"),
    (("--min-body-rate", "-1"), "--min-body-rate: expected KiB/s, 0 or above, got -1"),
    (("--api-key-file", "/nonexistent/key"), "--api-key-file /nonexistent/key: cannot read it"),
    (("--header-timeout", "soon"), "argument --header-timeout: invalid float value: 'soon'"),
], ids=["header_timeout_0", "header_timeout_nan", "body_timeout_negative", "max_connections_0", "max_body_mib_0",
        "body_memory_below_max_body", "peer_share_below_max_body", "peer_share_above_body_memory",
        "min_body_rate_negative", "api_key_file_missing", "header_timeout_not_a_number"])
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
