"""The front-ends as real processes on a live broker: ``shmbroker http`` (``start_frontend``) and ``shmbroker
inline`` (``start_inline``, ``broker_with_gateway``), and a caller of the inline gateway in plain pyzmq, as a C
or Go program would be (``inline_envelope``, ``ask_inline``, ``infer_inline``; several requests outstanding on
one DEALER: ``inline_dealer``, ``tiny_request``, ``inline_replies``, ``next_is_only``)."""

from __future__ import annotations

import contextlib
import http.client
import os
import re
import shutil
import socket
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np
import zmq

from shmbroker.broker.common import protocol as P
from shmbroker.broker.common.protocol import MsgKind
from tests.conftest import CLI, REPO, RunningBroker, start_broker

if TYPE_CHECKING:  # imported when used: the inline gateway's tests need no HTTP client
    import tritonclient.http as th


class UnixHTTPConnection(http.client.HTTPConnection):
    """http.client over a Unix socket (``shmbroker http --unix``)."""

    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self.path)
        self.sock = sock


@dataclass
class Front:
    host: str
    port: int
    proc: subprocess.Popen[str]
    broker: RunningBroker
    log_path: Path
    unix: str = ""  # the Unix socket it listens on instead of host:port

    @property
    def url(self) -> str:
        return f"{self.host}:{self.port}"

    def client(self, concurrency: int = 1) -> th.InferenceServerClient:
        import tritonclient.http as th

        return th.InferenceServerClient(self.url, concurrency=concurrency, network_timeout=60.0)

    def raw(self, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None,
            source: str = "") -> tuple[int, dict[str, str], bytes]:
        """One request on a fresh connection, from the address ``source`` if given (127.0.0.2 and so on: the
        front-end tells peers apart by address): (status, headers, body)."""
        conn = (UnixHTTPConnection(self.unix, timeout=60) if self.unix
                else http.client.HTTPConnection(self.host, self.port, timeout=60,
                                                source_address=(source, 0) if source else None))
        try:
            conn.request(method, path, body=body, headers=headers or {})
            resp = conn.getresponse()
            return resp.status, dict(resp.getheaders()), resp.read()
        finally:
            conn.close()


def start_frontend(b: RunningBroker, log_path: Path, workers: int = 2, extra: tuple[str, ...] = (),
                   unix: Path | None = None, max_fds: int = 0) -> Front:
    """`shmbroker http --port 0` (or `--unix UNIX`); returns once it printed its ready line (every process has
    its session). ``max_fds``: its open-files limit, soft and hard (0: this process's)."""
    env = dict(os.environ, SHMBROKER_RUNTIME_DIR=str(b.runtime_dir), PYTHONUNBUFFERED="1")
    where = ["--unix", str(unix)] if unix else ["--port", "0"]
    with open(log_path, "wb") as logf:
        limit = ["prlimit", f"--nofile={max_fds}:{max_fds}", "--"] if max_fds else []
        proc = subprocess.Popen([*limit, *CLI, "http", "--workers", str(workers), *where,
                                 "--slots", "32", *extra], env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=logf,
                                text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()  # blocks until ready, or EOF when it failed
    m = re.search(r"(\d+) front-end processes ready on (?:http://([\d.]+):(\d+)|unix:(.+))$", line.strip())
    if m is None:
        proc.kill()
        raise AssertionError(f"no ready line, got {line!r}; log:\n{log_path.read_text()[-4000:]}")
    assert int(m.group(1)) == workers
    if unix:
        assert m.group(4) == str(unix), line
        return Front("", 0, proc, b, log_path, unix=str(unix))
    return Front(m.group(2), int(m.group(3)), proc, b, log_path)


def start_inline(b: RunningBroker, log_path: Path, *extra: str) -> tuple[subprocess.Popen[str], list[str]]:
    """`shmbroker inline`; returns once it printed its ready line, with the endpoints it listens on."""
    env = dict(os.environ, SHMBROKER_RUNTIME_DIR=str(b.runtime_dir), PYTHONUNBUFFERED="1")
    with open(log_path, "wb") as logf:
        proc = subprocess.Popen([*CLI, "inline", "--slots", "16", *extra], env=env,
                                cwd=REPO, stdout=subprocess.PIPE, stderr=logf, text=True)
    line = proc.stdout.readline() if proc.stdout is not None else ""
    m = re.match(r"shmbroker inline: ready on (.+)$", line.strip())
    if m is None:
        proc.kill()
        raise AssertionError(f"no ready line, got {line!r}; log:\n{log_path.read_text()[-4000:]}")
    return proc, m.group(1).split()


def stop_inline(proc: subprocess.Popen[str]) -> int:
    """SIGTERM to a gateway (or any front-end process); its exit status."""
    proc.terminate()
    return proc.wait(30)


@contextlib.contextmanager
def broker_with_gateway(tmp: Path, *extra: str) -> Iterator[tuple[RunningBroker, list[str]]]:
    """A broker and `shmbroker inline` (with ``extra`` options) on it; both must stop cleanly and leave no segment."""
    b = start_broker(tmp, "process")
    try:
        proc, endpoints = start_inline(b, tmp / "inline.log", *extra)
    except BaseException:
        b.stop()
        raise
    try:
        yield b, endpoints
    except BaseException:  # a failed test: stop both anyway, and report its failure, not theirs
        stop_inline(proc)
        b.stop()
        raise
    assert stop_inline(proc) == 0, (tmp / "inline.log").read_text()[-3000:]
    assert b.stop_released() == 0, b.log()


C_EXAMPLE = REPO / "examples" / "c"


def have_libzmq() -> bool:
    """Whether examples/c can be built here: a C compiler and libzmq's headers (.ci/run installs both)."""
    return shutil.which("cc") is not None and (
        subprocess.run(["pkg-config", "--exists", "libzmq"], check=False).returncode == 0
        if shutil.which("pkg-config") else Path("/usr/include/zmq.h").exists())


def build_c_client(out: Path) -> Path:
    """examples/c built with its Makefile into ``out``; the program's path."""
    subprocess.run(["make", "-s", "-C", str(C_EXAMPLE), f"OUT={out}"], check=True)
    return out / "shmb_client"


def inline_envelope(kind: int) -> bytes:
    """The first frame of an inline-gateway message of ``kind`` (frontend.inline's INLINE_*)."""
    return P.ENVELOPE.pack(P.PROTOCOL_VERSION, kind)


def ask_inline(sock: zmq.Socket[bytes], frames: list[bytes]) -> list[bytes]:
    """Send ``frames`` on a DEALER connected to the gateway; its reply (60 s at most)."""
    sock.send_multipart(frames)
    assert sock.poll(60_000), "no answer from the gateway"
    return sock.recv_multipart()


def infer_inline(sock: zmq.Socket[bytes], model: str, name: str, x: np.ndarray,
                 rid: int = 7) -> tuple[dict[str, Any], list[bytes]]:
    """One request of one input through the gateway: (the reply's header, its output frames)."""
    header = {"id": rid, "model": model, "inputs": [{"name": name, "dtype": x.dtype.name, "shape": list(x.shape)}]}
    reply = ask_inline(sock, [inline_envelope(MsgKind.INLINE_REQUEST), msgspec.json.encode(header), x.tobytes()])
    assert reply[0] == inline_envelope(MsgKind.INLINE_REPLY)
    return msgspec.json.decode(reply[1]), reply[2:]


TINY_X = np.ones((1, 256), np.float32)  # an input of the tiny model: 1024 bytes


@contextlib.contextmanager
def inline_dealer(endpoint: str) -> Iterator[zmq.Socket[bytes]]:
    """A DEALER connected to the gateway that drops nothing on its side, however many replies wait."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.connect(endpoint)
        yield sock
    finally:
        ctx.destroy(linger=0)


def tiny_request(rid: int, timeout_us: int = 0, x: np.ndarray = TINY_X) -> list[bytes]:
    """The frames of a correct request of the tiny model with id ``rid``."""
    head = {"id": rid, "model": "tiny", "inputs": [{"name": "x", "dtype": "float32", "shape": list(x.shape)}],
            "timeout_us": timeout_us}
    return [inline_envelope(MsgKind.INLINE_REQUEST), msgspec.json.encode(head), x.tobytes()]


def inline_replies(sock: zmq.Socket[bytes], count: int, wait_ms: int = 60_000) -> list[dict[str, Any]]:
    """The headers of the next ``count`` replies, each awaited up to ``wait_ms``."""
    heads: list[dict[str, Any]] = []
    for _ in range(count):
        assert sock.poll(wait_ms), f"{len(heads)} replies of {count} came: {heads[-3:]}"
        frames = sock.recv_multipart()
        assert frames[0] == inline_envelope(MsgKind.INLINE_REPLY), frames[:2]
        heads.append(msgspec.json.decode(frames[1]))
    return heads


def next_is_only(sock: zmq.Socket[bytes], rid: int) -> dict[str, Any]:
    """Send a correct request and return its reply, which must be the next one: no late or second reply of an
    earlier request comes before it."""
    sock.send_multipart(tiny_request(rid))
    (head,) = inline_replies(sock, 1)
    assert head["id"] == rid, f"a reply of an earlier request came late: {head}"
    return head


def flood_a_stalled_worker(b: RunningBroker, sock: zmq.Socket[bytes], n: int, held: int, x: np.ndarray,
                           option: str) -> None:
    """Requests 1..``n`` of ``x`` on ``sock`` while the broker's workers are stopped: the first ``held`` wait,
    the rest are answered OVERLOADED at once naming ``option``; once the workers go on, the held ones are
    answered OK, each once, and the gateway serves on."""
    assert next_is_only(sock, n + 900)["status"] == "OK"  # linked and warm
    with b.workers_stopped():
        for rid in range(1, n + 1):
            sock.send_multipart(tiny_request(rid, timeout_us=120_000_000, x=x))  # held until the worker goes on
        refused = inline_replies(sock, n - held)
    assert sorted(h["id"] for h in refused) == list(range(held + 1, n + 1)), [h["id"] for h in refused]
    assert {h["status"] for h in refused} == {"OVERLOADED"}
    assert option in refused[0]["message"], refused[0]
    answered = inline_replies(sock, held)
    assert sorted(h["id"] for h in answered) == list(range(1, held + 1))
    assert {h["status"] for h in answered} == {"OK"}, [h for h in answered if h["status"] != "OK"][:3]
    assert next_is_only(sock, n + 901)["status"] == "OK"
