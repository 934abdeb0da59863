"""The HTTP front-end against a live broker, driven by the official Triton client (tritonclient[http]).

Real processes: `shmbroker serve`, then `shmbroker http --workers 2` (two front-end processes on one port),
then tritonclient and plain http.client requests over TCP; `--unix`: plain requests over a Unix socket.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import gevent
import numpy as np
import psutil
import pytest
import tritonclient.http as th
from tritonclient.utils import InferenceServerException

from tests.conftest import CLI, REPO, start_broker, wait_until
from tests.frontends import Front, start_frontend
from tests.models import direct


@pytest.fixture(scope="module")
def front(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Front]:
    tmp = tmp_path_factory.mktemp("http")
    b = start_broker(tmp, "process")
    try:
        f = start_frontend(b, tmp / "http.log")
    except BaseException:
        b.stop()
        raise
    try:
        yield f
    finally:
        f.proc.send_signal(signal.SIGTERM)
        rc = f.proc.wait(60)
        brc = b.stop_released()
        assert rc == 0, f"shmbroker http exited {rc}\n{f.log_path.read_text()[-4000:]}"
        assert brc == 0, b.log()


def _input(name: str, x: np.ndarray, binary: bool) -> th.InferInput:
    i = th.InferInput(name, list(x.shape), "FP32")
    i.set_data_from_numpy(x, binary_data=binary)
    return i


def test_server_live_ready_and_metadata(front: Front) -> None:
    c = front.client()
    assert c.is_server_live()
    assert c.is_server_ready()
    assert c.is_model_ready("nsfw") and c.is_model_ready("tiny")
    assert not c.is_model_ready("nope")
    assert c.get_server_metadata()["extensions"] == ["binary_tensor_data"]
    meta = c.get_model_metadata("nsfw")
    assert meta["name"] == "nsfw"
    assert meta["inputs"] == [{"name": "input:0", "datatype": "FP32", "shape": [-1, 224, 224, 3]}]
    assert meta["outputs"] == [{"name": "outputs", "datatype": "FP32", "shape": [-1, 2]}]
    assert c.get_model_metadata("tiny")["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 256]}]


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_infer_matches_onnxruntime(front: Front, binary: bool) -> None:
    c = front.client()
    rng = np.random.default_rng(7)
    for rows in (1, 3, 16):
        x = rng.standard_normal((rows, 256), dtype=np.float32)
        r = c.infer("tiny", [_input("x", x, binary)], request_id=f"r{rows}",
                    outputs=[th.InferRequestedOutput("y", binary_data=binary)])
        y = r.as_numpy("y")
        assert y is not None and y.shape == (rows, 256) and y.dtype == np.float32
        np.testing.assert_allclose(y, direct("tiny", x), rtol=0, atol=1e-5)
        assert r.get_response()["id"] == f"r{rows}"
        out = r.get_output("y")
        assert out is not None and ("binary_data_size" in out.get("parameters", {})) == binary
    for rows in (1, 4):
        x = rng.random((rows, 224, 224, 3), dtype=np.float32)
        r = c.infer("nsfw", [_input("input:0", x, binary)])  # no outputs named: all, binary (tritonclient's default)
        scores = r.as_numpy("outputs")
        assert scores is not None and scores.shape == (rows, 2)
        np.testing.assert_allclose(scores, direct("nsfw", x), rtol=0, atol=1e-5)


def test_binary_input_with_json_output_over_plain_http(front: Front) -> None:
    """The binary extension byte by byte, as curl would send it: JSON header, then the tensor's bytes."""
    x = np.arange(256, dtype=np.float32).reshape(1, 256) / 256
    header = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 256],
                                     "parameters": {"binary_data_size": x.nbytes}}]}).encode()
    status, headers, body = front.raw("POST", "/v2/models/tiny/infer", header + x.tobytes(),
                                      {"Inference-Header-Content-Length": str(len(header))})
    assert status == 200, body
    assert headers["Content-Type"].startswith("application/json")
    doc = json.loads(body)
    assert doc["model_name"] == "tiny" and doc["outputs"][0]["shape"] == [1, 256]
    y = np.array(doc["outputs"][0]["data"], np.float32).reshape(1, 256)
    np.testing.assert_allclose(y, direct("tiny", x), rtol=0, atol=1e-5)


def _status_of(exc: InferenceServerException) -> int:
    return int(str(exc.status()))


def test_errors_carry_the_protocol_codes(front: Front) -> None:
    c = front.client()
    x = np.ones((1, 256), np.float32)
    calls: list[tuple[Callable[[], object], int, str]] = [
        (lambda: c.get_model_metadata("nope"), 404, "'nope'"),
        (lambda: c.infer("nope", [_input("x", x, True)]), 404, "not served"),
        (lambda: c.infer("tiny", [_input("x", np.ones((1, 255), np.float32), True)]), 400, "inputs[0].shape"),
        (lambda: c.infer("tiny", [_input("z", x, True)]), 400, "inputs[0].name"),
        (lambda: c.infer("tiny", [_input("x", np.ones((17, 256), np.float32), True)]), 400, "rows"),
        (lambda: c.infer("tiny", [_input("x", x, True)], timeout=1), 504, "TIMEOUT"),  # 1 us: expires in the queue
    ]
    for call, want, text in calls:
        with pytest.raises(InferenceServerException) as ei:
            call()
        assert _status_of(ei.value) == want, ei.value.message()
        assert text in str(ei.value.message())


def test_bad_bodies_are_400_with_the_field_named(front: Front) -> None:
    x = np.ones((1, 256), np.float32)
    binary = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 256],
                                     "parameters": {"binary_data_size": 1024}}]}).encode()
    wrong_type = {"inputs": [{"name": "x", "datatype": "INT64", "shape": [1, 256], "data": [0] * 256}]}
    short_data = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 256], "data": [1.0, 2.0]}]}
    for body, header_length, field in [
        (b"{not json", None, "request body"),
        (json.dumps(wrong_type).encode(), None, "inputs[0].datatype"),
        (json.dumps(short_data).encode(), None, "inputs[0].data"),
        (binary + x.tobytes()[:1000], len(binary), "inputs[0].parameters.binary_data_size"),
        (binary + x.tobytes(), len(binary) + 2000, "Inference-Header-Content-Length"),
    ]:
        headers = {} if header_length is None else {"Inference-Header-Content-Length": str(header_length)}
        status, _h, resp = front.raw("POST", "/v2/models/tiny/infer", body, headers)
        assert status == 400, resp
        assert field in json.loads(resp)["error"]
    status, _h, resp = front.raw("GET", "/v2/nothing/here")
    assert status == 404 and "error" in json.loads(resp)


def test_a_max_batch_request_is_served_through_slots_of_fewer_rows(front: Front, tmp_path: Path) -> None:
    """`--max-items 2`: slots of 2 rows; a request of tiny's max_batch (16) rows is sent as parts and answered whole,
    one past it is 400 naming the model's limit."""
    small = start_frontend(front.broker, tmp_path / "small.log", workers=1, extra=("--max-items", "2"))
    try:
        x = np.random.default_rng(8).standard_normal((16, 256), dtype=np.float32)
        r = small.client().infer("tiny", [_input("x", x, True)])
        y = r.as_numpy("y")
        assert y is not None
        np.testing.assert_allclose(y, direct("tiny", x), rtol=0, atol=1e-5)
        body = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [17, 256],
                                       "data": [1.0] * (256 * 17)}]}).encode()
        status, _h, resp = small.raw("POST", "/v2/models/tiny/infer", body)
        assert status == 400, resp
        assert "model 'tiny' has max_batch 16" in json.loads(resp)["error"]
    finally:
        small.proc.send_signal(signal.SIGTERM)
        assert small.proc.wait(60) == 0


def test_a_wait_for_a_slot_past_the_timeout_is_504_naming_the_front_ends_option(front: Front, tmp_path: Path) -> None:
    one = start_frontend(front.broker, tmp_path / "one.log", workers=1, extra=("--slots", "1"))

    def body(timeout_us: int | None) -> bytes:
        params = {"parameters": {"timeout": timeout_us}} if timeout_us else {}
        return json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 256], "data": [1.0] * 256}],
                           **params}).encode()

    try:
        first: list[int] = []
        with front.broker.workers_stopped():
            before = front.broker.submitted_slots()
            holder = threading.Thread(target=lambda: first.append(one.raw("POST", "/v2/models/tiny/infer",
                                                                          body(None))[0]))
            holder.start()  # takes the front-end's only slot until the workers go on
            deadline = time.monotonic() + 30
            while front.broker.submitted_slots() == before and time.monotonic() < deadline:
                time.sleep(0.005)  # a test's poll of the ring, not a wait in the product
            status, _h, resp = one.raw("POST", "/v2/models/tiny/infer", body(200_000))
        assert status == 504, resp
        error = json.loads(resp)["error"]
        assert "no free slot within 0.2 s" in error and "shmbroker http --slots" in error, error
        holder.join(60)
        assert first == [200]
    finally:
        one.proc.send_signal(signal.SIGTERM)
        assert one.proc.wait(60) == 0


def test_overload_is_503_and_the_rest_succeed(front: Front) -> None:
    """24 nsfw requests at once against a queue of 3 (max_queue_size in the test config): some are refused.

    The worker is stopped until all 24 are posted in the front-end's rings, so they reach it together however
    slowly the front-end takes them in; it then admits a queue's worth and answers the rest OVERLOADED.
    """
    c = front.client(concurrency=24)
    x = np.random.default_rng(3).random((1, 224, 224, 3), dtype=np.float32)
    with front.broker.workers_stopped():
        handles = [c.async_infer("nsfw", [_input("input:0", x, True)]) for _ in range(24)]
        deadline = time.monotonic() + 30
        posted = 0
        while posted < 24 and time.monotonic() < deadline:
            gevent.sleep(0.005)  # the HTTP requests go out on gevent's loop: yield to it while polling the rings
            posted = front.broker.submitted_slots()
    assert posted == 24, f"{posted} of 24 requests were posted in the front-end's rings within 30 s"
    statuses: list[int] = []
    for h in handles:
        try:
            scores = h.get_result().as_numpy("outputs")
            np.testing.assert_allclose(scores, direct("nsfw", x), rtol=0, atol=1e-5)
            statuses.append(200)
        except InferenceServerException as exc:
            assert "OVERLOADED" in exc.message(), exc.message()
            statuses.append(_status_of(exc))
    c.close()
    assert set(statuses) == {200, 503}, statuses


def test_two_processes_share_the_port(front: Front) -> None:
    children = {p.pid for p in psutil.Process(front.proc.pid).children()}
    answered = set()
    # each fresh connection goes to whichever process accepts from the shared socket first: about one in two
    # each, but on a loaded machine one may win a run of them, so ask until both answered (256 at most)
    for _ in range(256):
        status, headers, _body = front.raw("GET", "/v2/health/live")
        assert status == 200
        answered.add(int(headers["X-Shmbroker-Frontend-Pid"]))
        if len(answered) == 2:
            break
    assert len(answered) == 2 and answered <= children, (answered, children)


def test_a_second_http_on_the_port_refuses_to_start(front: Front) -> None:
    """A second `shmbroker http` on the port exits 2 naming the port and --port; nothing of this user may join
    the port with SO_REUSEPORT either; the first one keeps every connection."""
    env = dict(os.environ, SHMBROKER_RUNTIME_DIR=str(front.broker.runtime_dir))
    r = subprocess.run([*CLI, "http", "--workers", "1", "--port", str(front.port)],
                       env=env, cwd=REPO, capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 2, r.stderr
    assert f"{front.host}:{front.port}" in r.stderr and "--port" in r.stderr and "in use" in r.stderr, r.stderr
    intruder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        intruder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        with pytest.raises(OSError, match="Address already in use"):
            intruder.bind((front.host, front.port))
    finally:
        intruder.close()
    children = {p.pid for p in psutil.Process(front.proc.pid).children()}
    for _ in range(8):
        status, headers, _body = front.raw("GET", "/v2/health/live")
        assert status == 200 and int(headers["X-Shmbroker-Frontend-Pid"]) in children


def _until(status: int, ask: Callable[[], int], tries: int = 600) -> int:
    """Ask until the answer is ``status`` (each ask waits for the server; the bound only ends a broken run)."""
    got = ask()
    for _ in range(tries):
        if got == status:
            break
        gevent.sleep(0.05)
        got = ask()
    return got


def test_a_broker_restart_makes_ready_503_then_serves_again(tmp_path: Path) -> None:
    b = start_broker(tmp_path, "process")
    f = start_frontend(b, tmp_path / "http.log", workers=1)
    body = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 256], "data": [1.0] * 256}]})

    def ready() -> int:
        return f.raw("GET", "/v2/health/ready")[0]

    def infer() -> int:
        return f.raw("POST", "/v2/models/tiny/infer", body.encode())[0]

    try:
        assert ready() == 200 and infer() == 200
        assert b.stop() == 0, b.log()
        assert _until(503, ready) == 503  # never 200 on ready while an infer cannot succeed
        status, _h, resp = f.raw("POST", "/v2/models/tiny/infer", body.encode())
        assert status == 503, resp
        b = start_broker(tmp_path, "process")  # the same runtime directory
        assert _until(200, ready) == 200
        assert infer() == 200
    finally:
        f.proc.send_signal(signal.SIGTERM)
        assert f.proc.wait(60) == 0
        assert b.stop() == 0, b.log()


def test_a_front_end_that_waits_for_the_broker_warns_once_then_serves(tmp_path: Path) -> None:
    """Started before the broker, it retries every second; the reason is logged at WARNING once (and again only
    when it changes), each retry at DEBUG."""
    log_path = tmp_path / "http.log"
    env = dict(os.environ, SHMBROKER_RUNTIME_DIR=str(tmp_path / "run"), PYTHONUNBUFFERED="1")
    with open(log_path, "wb") as logf:
        proc = subprocess.Popen([*CLI, "http", "--workers", "1", "--port", "0", "--log-level", "DEBUG"], env=env,
                                cwd=REPO, stdout=subprocess.PIPE, stderr=logf, text=True)
    b = None
    try:
        wait_until(lambda: log_path.read_text().count("still no session with the broker") >= 3, "three retries")
        waiting = log_path.read_text()
        warnings = [line for line in waiting.splitlines() if " WARNING " in line]
        assert len(warnings) == 1 and "no session with the broker on" in warnings[0], warnings
        b = start_broker(tmp_path, "process")  # the same runtime directory
        assert proc.stdout is not None
        assert "front-end processes ready on" in proc.stdout.readline(), log_path.read_text()[-4000:]
        assert "session with the broker on" in log_path.read_text()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log_path.read_text()[-4000:]
        if b is not None:
            assert b.stop() == 0, b.log()


def _http_unix(front: Front, path: Path) -> subprocess.CompletedProcess[str]:
    """`shmbroker http --unix PATH` that is expected to refuse to start."""
    env = dict(os.environ, SHMBROKER_RUNTIME_DIR=str(front.broker.runtime_dir))
    return subprocess.run([*CLI, "http", "--workers", "1", "--unix", str(path)],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=60, check=False)


def _stop(f: Front) -> None:
    f.proc.send_signal(signal.SIGTERM)
    assert f.proc.wait(60) == 0, f.log_path.read_text()[-4000:]


def test_a_unix_socket_serves_its_owner_and_group_and_goes_at_the_stop(front: Front, tmp_path: Path) -> None:
    path = tmp_path / "http.sock"
    f = start_frontend(front.broker, tmp_path / "unix.log", workers=1, unix=path)
    try:
        assert stat.S_ISSOCK(path.stat().st_mode) and stat.S_IMODE(path.stat().st_mode) == 0o660
        status, _headers, body = f.raw("GET", "/v2/models/tiny")
        assert status == 200 and json.loads(body)["name"] == "tiny"
        x = np.ones((1, 256), np.float32)
        req = {"inputs": [{"name": "x", "shape": [1, 256], "datatype": "FP32", "data": x.ravel().tolist()}]}
        status, _headers, body = f.raw("POST", "/v2/models/tiny/infer", json.dumps(req).encode(),
                                       {"Content-Type": "application/json"})
        assert status == 200, body
        got = np.array(json.loads(body)["outputs"][0]["data"], np.float32).reshape(1, 256)
        np.testing.assert_allclose(got, direct("tiny", x), rtol=0, atol=1e-5)
        second = _http_unix(front, path)
        assert second.returncode == 2, second.stderr
        assert "--unix" in second.stderr and f"{path}.lock" in second.stderr, second.stderr
        assert f.raw("GET", "/v2/health/live")[0] == 200  # the first one still serves its socket
    finally:
        _stop(f)
    assert not path.exists(), "the socket file outlived the stop"
    assert Path(f"{path}.lock").exists()  # kept: frontend.unixclaim says why; a new front-end takes it over
    again = start_frontend(front.broker, tmp_path / "again.log", workers=1, unix=path)
    _stop(again)


def test_a_stale_unix_socket_is_replaced_and_anything_else_there_refused(front: Front, tmp_path: Path) -> None:
    stale = tmp_path / "stale.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as dead:
        dead.bind(str(stale))  # what a killed front-end leaves: a socket file nobody listens on
    f = start_frontend(front.broker, tmp_path / "stale.log", workers=1, unix=stale)
    try:
        assert f.raw("GET", "/v2/health/ready")[0] == 200
    finally:
        _stop(f)
    other = tmp_path / "other.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as live:
        live.bind(str(other))
        live.listen(1)  # another program's server
        r = _http_unix(front, other)
        assert r.returncode == 2 and "another process listens" in r.stderr and "--unix" in r.stderr, r.stderr
        assert other.exists()
    regular = tmp_path / "notes.txt"
    regular.write_text("keep me")
    r = _http_unix(front, regular)
    assert r.returncode == 2 and "not a socket" in r.stderr and "--unix" in r.stderr, r.stderr
    assert regular.read_text() == "keep me"
    r = _http_unix(front, tmp_path / "missing" / "http.sock")
    assert r.returncode == 2 and "does not exist" in r.stderr, r.stderr
