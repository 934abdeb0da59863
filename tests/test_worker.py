"""gpu_worker.worker against its broker, with this test in the broker's place: a real worker process
(``python -m shmbroker.gpu_worker.process``, as the broker starts it, the config as JSON on its stdin) and a
ROUTER on the runtime directory's workers socket, over real ZeroMQ.

What the broker, and through it a user, sees of a worker: it says HELLO, then READY with its data endpoint and
the models it loaded (health and the clients' SETUP come from that), or WORKER_FAILED with the reason (the
reason ``shmbroker serve`` stops with); it answers STATS by id, counting every SUBMIT it dropped unanswered by
reason; a session whose ring it cannot map is refused, and nothing of it stays; SHUTDOWN, SIGTERM or its
broker's death end it with status 0 and its socket file removed. What it answers to requests is tested
through a live broker in tests/test_worker_errors.py and, for each check of intake, in tests/test_intake.py.
"""

from __future__ import annotations

import contextlib
import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import pytest
import zmq

from shmbroker.broker.common import protocol as P
from shmbroker.broker.common import runtime
from shmbroker.broker.common.config import Config, parse
from tests.conftest import REPO, process_gone

M = TypeVar("M", bound=msgspec.Struct)
WAIT_S = 60.0  # for a message that must come (a loaded machine may be slow); never a measurement
TINY = {"path": "builtin:tiny", "max_batch": 16, "timeout_ms": 2000, "intra_op_threads": 1}
TINY_INFO = P.ModelInfo(0, "tiny", 16, [P.TensorSpec("x", "float32", [-1, 256])],
                        [P.TensorSpec("y", "float32", [-1, 256])], 2000)


def _config(models: dict[str, dict[str, Any]]) -> Config:
    return parse({"broker": {"log_level": "INFO"}, "worker": {"spin_us": 0}, "models": models})


class FakeBroker:
    """The broker's end of the workers socket, bound in ``runtime_dir``; the worker's routing id is learnt
    from its first message."""

    def __init__(self, runtime_dir: Path) -> None:
        self.runtime_dir = runtime_dir
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.bind(runtime.endpoint(runtime_dir, runtime.WORKERS_SOCKET))
        self.identity = b""

    def recv(self, kind: type[M], wait: float = WAIT_S) -> M:
        if not self.sock.poll(int(wait * 1000)):
            raise AssertionError(f"no {getattr(kind, '__name__', kind)} from the worker within {wait} s")
        self.identity, *frames = self.sock.recv_multipart()
        msg = P.decode(frames)
        if not isinstance(msg, kind):  # a union of kinds too
            raise AssertionError(f"expected {getattr(kind, '__name__', kind)}, got {msg!r}")
        return msg

    def started(self, kind: type[M], wait: float = WAIT_S) -> tuple[M, list[str]]:
        """The worker's ``kind`` (WorkerReady or WorkerFailed) that ends its start, and the steps it reported
        before it (WorkerProgress)."""
        steps = []
        while True:
            msg = self.recv(P.WorkerProgress | kind, wait)  # type: ignore[arg-type]
            if not isinstance(msg, P.WorkerProgress):
                return msg, steps
            steps.append(msg.step)

    def send(self, msg: msgspec.Struct) -> None:
        self.sock.send_multipart([self.identity, *P.encode(msg)])

    def stats(self, request_id: int) -> P.WorkerStats:
        self.send(P.WorkerStatsRequest(request_id))
        reply = self.recv(P.WorkerStatsReply)
        assert reply.request_id == request_id
        return reply.stats

    def close(self) -> None:
        self.ctx.destroy(linger=0)


def _worker_command(runtime_dir: Path) -> list[str]:
    return [sys.executable, "-m", "shmbroker.gpu_worker.process", "--worker-id", "0", "--runtime-dir", str(runtime_dir)]


def start_worker(runtime_dir: Path, cfg: Config, log_path: Path) -> subprocess.Popen[bytes]:
    """The worker process as the broker starts it: the validated config as JSON on its stdin."""
    with open(log_path, "wb") as logf:
        proc = subprocess.Popen(_worker_command(runtime_dir), stdin=subprocess.PIPE, stdout=logf,
                                stderr=subprocess.STDOUT, cwd=REPO, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert proc.stdin is not None
    proc.stdin.write(msgspec.json.encode(cfg))
    proc.stdin.close()
    return proc


@dataclass
class Served:
    broker: FakeBroker
    proc: subprocess.Popen[bytes]
    hello: P.WorkerHello
    ready: P.WorkerReady
    steps: list[str]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]


@contextlib.contextmanager
def serving(tmp: Path, models: dict[str, dict[str, Any]] | None = None) -> Iterator[Served]:
    """A worker process that said HELLO and READY to this test; killed on leaving if it still runs."""
    runtime_dir = tmp / "run"
    runtime_dir.mkdir(mode=0o700)
    broker = FakeBroker(runtime_dir)
    proc = start_worker(runtime_dir, _config(models or {"tiny": TINY}), tmp / "worker.log")
    try:
        hello = broker.recv(P.WorkerHello)
        yield Served(broker, proc, hello, *broker.started(P.WorkerReady), tmp / "worker.log")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        broker.close()


def submit_frames(session_id: int, token: int) -> list[bytes]:
    """A well-formed SUBMIT of one tiny request in slot 0."""
    req = P.SubmitRequest(1, 0, 1, 0, 0, [P.TensorDesc(0, P.DType.FP32, 0, 1024, (1, 256))])
    return P.encode_submit(P.SubmitBatch(session_id, token, [req]))


def until_dropped(served: Served, counts: dict[str, int]) -> P.WorkerStats:
    """STATS until the drop counts reach ``counts`` (the data socket is not the control socket: the worker may
    answer STATS before it has read what was sent to the other), then once more; that last answer."""
    end = time.monotonic() + WAIT_S
    rid = 100
    while True:
        rid += 1
        stats = served.broker.stats(rid)
        if all(stats.dropped.get(k, 0) >= n for k, n in counts.items()) or time.monotonic() > end:
            return served.broker.stats(rid + 1)
        time.sleep(0.01)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    with serving(tmp_path_factory.mktemp("worker")) as s:
        yield s


def test_hello_then_ready_name_the_worker_its_private_endpoint_and_its_models(served: Served) -> None:
    assert served.hello == P.WorkerHello(P.PROTOCOL_VERSION, 0, served.proc.pid)
    assert served.ready == P.WorkerReady(0, runtime.worker_endpoint(served.broker.runtime_dir, 0), [TINY_INFO])
    path = served.ready.endpoint.removeprefix("ipc://")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600  # only the broker's user (no broker.group set)
    # each step of its start reported before it is taken: the broker's start deadline counts from the latest
    assert served.steps == ["model tiny (1 of 1): loading its onnxruntime engine",
                            "model tiny (1 of 1): building its runner",
                            "model tiny (1 of 1): warming up its engine at 1 and 16 rows"]


def test_stats_are_answered_by_id_and_count_submits_dropped_without_an_answer(served: Served) -> None:
    """Messages on the data socket that name no session of the worker, or that are no SUBMIT, get no answer
    (there is nobody to answer); STATS says how many, by reason, so that a client whose requests are never
    answered can be told why."""
    before = served.broker.stats(1)
    assert (before.worker_id, before.pid, before.device, before.in_flight) == (0, served.proc.pid, "cpu", 0)
    assert [m.name for m in before.models] == ["tiny"]
    push = served.broker.ctx.socket(zmq.PUSH)
    push.connect(served.ready.endpoint)
    push.send_multipart([b"not an envelope"])
    push.send_multipart(P.encode(P.Bye(5)))  # a control message: the data socket takes only SUBMIT
    push.send_multipart(submit_frames(12345, 1))  # a session the worker was never asked to attach
    sent = {P.DropReason.MALFORMED: 2, P.DropReason.UNKNOWN_SESSION: 1}
    want = {**before.dropped, **{k: before.dropped.get(k, 0) + n for k, n in sent.items()}}
    after = until_dropped(served, want)
    push.close(0)
    assert after.dropped == want, served.log()
    assert after.in_flight == 0


def test_a_session_whose_ring_cannot_be_mapped_is_refused_and_leaves_nothing(served: Served) -> None:
    """ATTACH for a ring the worker cannot map (no broker hands it out): ATTACH_FAILED names the session, no
    session is made (its SUBMITs are dropped as for an unknown one), and the worker goes on serving."""
    # the fields of ATTACH in either protocol version (v1 names a segment, v2 the client's uid): those that
    # P.Attach does not have are left out
    fields: dict[str, Any] = {"session_id": 77, "token": 99, "segment": "shmb-gone-0", "segment_bytes": 8192,
                              "n_slots": 1, "slot_stride": 4096, "in_capacity": 1024, "out_capacity": 1024,
                              "max_items": 1, "client_uid": os.getuid()}
    served.broker.send(P.Attach(**{k: v for k, v in fields.items() if k in P.Attach.__struct_fields__}))
    failed = served.broker.recv(P.AttachFailed)
    assert failed.session_id == 77 and failed.reason
    before = served.broker.stats(2).dropped.get(P.DropReason.UNKNOWN_SESSION, 0)
    push = served.broker.ctx.socket(zmq.PUSH)
    push.connect(served.ready.endpoint)
    push.send_multipart(submit_frames(77, 99))
    after = until_dropped(served, {P.DropReason.UNKNOWN_SESSION: before + 1})
    push.close(0)
    assert after.dropped.get(P.DropReason.UNKNOWN_SESSION, 0) == before + 1


def test_a_model_that_cannot_load_is_reported_and_the_worker_exits_3(tmp_path: Path) -> None:
    bad = tmp_path / "broken.onnx"
    bad.write_bytes(b"not an ONNX model")
    runtime_dir = tmp_path / "run"
    runtime_dir.mkdir(mode=0o700)
    broker = FakeBroker(runtime_dir)
    try:
        proc = start_worker(runtime_dir, _config({"tiny": TINY, "broken": {"path": str(bad)}}),
                            tmp_path / "worker.log")
        assert broker.recv(P.WorkerHello).pid == proc.pid
        failed, steps = broker.started(P.WorkerFailed)
        assert proc.wait(30) == 3
    finally:
        broker.close()
    assert failed.worker_id == 0
    assert str(bad) in failed.reason, failed.reason  # the reason names the file that failed
    assert steps[-1] == "model broken (2 of 2): loading its onnxruntime engine", steps  # the step that failed
    assert not os.path.exists(runtime.worker_endpoint(runtime_dir, 0).removeprefix("ipc://"))


@pytest.mark.parametrize("how", ["shutdown", "sigterm"])
def test_shutdown_or_sigterm_end_the_worker_with_0_and_remove_its_socket(tmp_path: Path, how: str) -> None:
    with serving(tmp_path) as s:
        if how == "shutdown":
            s.broker.send(P.Shutdown())
        else:
            s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(30) == 0, s.log()
        assert not os.path.exists(s.ready.endpoint.removeprefix("ipc://"))


LAUNCHER = """
import subprocess, sys, time
p = subprocess.Popen(sys.argv[1:], stdin=subprocess.PIPE)
p.stdin.write(sys.stdin.buffer.read())
p.stdin.close()
print(p.pid, flush=True)
time.sleep(3600)
"""


def test_a_worker_whose_broker_dies_stops_cleanly(tmp_path: Path) -> None:
    """The worker's parent (the broker) is killed: the worker stops too (no orphan holding models or a GPU),
    cleanly: its socket file goes."""
    runtime_dir = tmp_path / "run"
    runtime_dir.mkdir(mode=0o700)
    broker = FakeBroker(runtime_dir)
    parent = subprocess.Popen([sys.executable, "-c", LAUNCHER, *_worker_command(runtime_dir)], cwd=REPO,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert parent.stdin is not None and parent.stdout is not None
        parent.stdin.write(msgspec.json.encode(_config({"tiny": TINY})))
        parent.stdin.close()
        worker = int(parent.stdout.readline())
        assert broker.recv(P.WorkerHello).pid == worker
        ready, _ = broker.started(P.WorkerReady)
        parent.kill()
        parent.wait(30)
        assert process_gone(worker, 30), "the worker outlived its broker"
        assert not os.path.exists(ready.endpoint.removeprefix("ipc://"))
    finally:
        if parent.poll() is None:
            parent.kill()
        broker.close()
