"""Photos through the front-ends that are separate processes: `shmbroker http` (a KServe v2 BYTES input with the
binary data extension, and one photo as the whole body), `shmbroker inline` (one frame per image) and the C client
(examples/c, its own ring and inline), on real broker and worker processes in both worker modes.

Each bad image (corrupt, truncated, not an image, over the pixel limit, a decompression bomb) is answered with
BAD_IMAGE naming its row and why, while good photos in flight beside it get the CPU reference recipe's scores; an
image over the model's max_image_bytes is refused naming that setting. (The ring clients' and the CLI's own tests
of the same rows are in tests/test_photos.py.)
"""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import zmq

from shmbroker.broker.common import protocol as P
from shmbroker.broker.common.protocol import MsgKind
from tests.conftest import RunningBroker, photo_model, start_broker
from tests.frontends import (
    Front,
    build_c_client,
    have_libzmq,
    inline_dealer,
    inline_envelope,
    inline_replies,
    start_frontend,
    start_inline,
    stop_inline,
)
from tests.photoset import bad_rows, good_rows, reference

MAX_BYTES = 1 << 20
MAX_BODY_MIB = 2  # the HTTP front-end's --max-body-mib
MODELS = photo_model(MAX_BYTES) + """
[models.tiny]
path = "builtin:tiny"
max_batch = 16
timeout_ms = 20000
"""
IMAGE_INPUT = "image"  # nsfw_photo's input (a model of images names its input so)


@dataclass
class Stack:
    broker: RunningBroker
    http: Front
    inline: str  # the gateway's endpoint


@pytest.fixture(scope="module", params=["process", "thread"])
def stack(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[Stack]:
    """A broker of nsfw_photo, `shmbroker http` (one process, --max-body-mib 2) and `shmbroker inline` on it; all
    three must stop cleanly."""
    tmp = tmp_path_factory.mktemp(f"photofront-{request.param}")
    b = start_broker(tmp, str(request.param), models=MODELS, sessions="default_slots = 8\ndefault_max_items = 4")
    started: list[subprocess.Popen[str]] = []
    try:
        front = start_frontend(b, tmp / "http.log", workers=1, extra=("--max-body-mib", str(MAX_BODY_MIB)))
        started.append(front.proc)
        gateway, endpoints = start_inline(b, tmp / "inline.log")
        started.append(gateway)
        yield Stack(b, front, endpoints[0])
    finally:
        codes = [stop_inline(p) for p in started]
        assert b.stop_released() == 0, b.log()
    assert codes == [0, 0], [(tmp / n).read_text()[-3000:] for n in ("http.log", "inline.log")]


def _scores(doc: dict[str, Any]) -> np.ndarray:
    out = doc["outputs"][0]
    return np.asarray(out["data"], np.float32).reshape(out["shape"])


def _content_type(data: bytes) -> str:
    return "image/png" if data.startswith(b"\x89PNG") else "image/jpeg"


def _post(front: Front, body: bytes, content_type: str, model: str = "nsfw_photo") -> tuple[int, dict[str, Any]]:
    status, _headers, data = front.raw("POST", f"/v2/models/{model}/infer", body, {"Content-Type": content_type})
    return status, json.loads(data)


# -- HTTP: one photo as the whole body ---------------------------------------------------------------------


def test_http_photo_body_bad_rows_alone(stack: Stack) -> None:
    """Each bad photo POSTed as the body, in flight with good ones: 400 naming row 0 and why; the good ones 200
    with the reference's scores, whatever the body's Content-Type (curl's default for --data-binary too)."""
    good, bad = good_rows(), bad_rows()
    want = reference(good)
    types = ["image/jpeg", "application/octet-stream", "application/x-www-form-urlencoded"]
    calls = [(name, data, _content_type(data)) for name, (data, _why) in bad.items()]
    calls += [(f"good{k}", data, types[k]) for k, data in enumerate(good)]
    with ThreadPoolExecutor(len(calls)) as pool:
        answers = list(pool.map(lambda c: _post(stack.http, c[1], c[2]), calls))
    for (name, _data, _ctype), (status, doc) in zip(calls, answers, strict=True):
        if name.startswith("good"):
            assert status == 200, (name, doc)
            assert doc["model_name"] == "nsfw_photo" and doc["outputs"][0]["shape"] == [1, 2]
            np.testing.assert_allclose(_scores(doc)[0], want[int(name[4:])], atol=1e-2)
        else:
            assert status == 400, (name, doc)
            assert "BAD_IMAGE" in doc["error"] and "row 0" in doc["error"] and bad[name][1] in doc["error"], doc


def test_http_photo_body_limits(stack: Stack) -> None:
    """Over max_image_bytes: 413 naming it; over --max-body-mib: 413 naming that; empty: 400; an image's
    Content-Type to a model of tensors: 415."""
    status, doc = _post(stack.http, b"\xff\xd8\xff" + bytes(MAX_BYTES), "image/jpeg")
    assert status == 413 and "models.nsfw_photo.max_image_bytes" in doc["error"], doc
    assert f"1..{MAX_BYTES} bytes" in doc["error"], doc
    status, doc = _post(stack.http, bytes(MAX_BODY_MIB << 20 | 1), "image/jpeg")
    assert status == 413 and "--max-body-mib" in doc["error"], doc
    status, doc = _post(stack.http, b"", "image/jpeg")
    assert status == 400 and "an image of 0 bytes" in doc["error"], doc
    status, doc = _post(stack.http, b"", "application/json", model="tiny")  # an empty body holds no memory
    assert status == 400 and "request body: expected a JSON object" in doc["error"], doc
    status, doc = _post(stack.http, good_rows()[0], "image/jpeg", model="tiny")
    assert status == 415 and "takes tensors, not images" in doc["error"], doc
    status, doc = _post(stack.http, good_rows()[0], "image/jpeg")  # the front-end serves on
    assert status == 200, doc


# -- HTTP: KServe v2 BYTES with the binary data extension ----------------------------------------------------


def _bytes_input(rows: list[bytes], shape: list[int] | None = None) -> Any:
    import tritonclient.http as th

    arr = np.empty(len(rows), dtype=object)
    arr[:] = rows
    i = th.InferInput(IMAGE_INPUT, shape or [len(rows)], "BYTES")
    i.set_data_from_numpy(arr.reshape(shape or [len(rows)]), binary_data=True)
    return i


def test_http_kserve_bytes_scores_photos(stack: Stack) -> None:
    """tritonclient's BYTES input, binary: several photos a request (shape [N] or [N, 1]), outputs binary or JSON."""
    import tritonclient.http as th

    good = good_rows()
    want = reference(good)
    c = stack.http.client()
    meta = c.get_model_metadata("nsfw_photo")
    assert meta["inputs"] == [{"name": IMAGE_INPUT, "datatype": "BYTES", "shape": [-1]}]
    r = c.infer("nsfw_photo", [_bytes_input(good)], outputs=[th.InferRequestedOutput("outputs", binary_data=True)])
    np.testing.assert_allclose(r.as_numpy("outputs"), want, atol=1e-2)
    r = c.infer("nsfw_photo", [_bytes_input(good[:2], [2, 1])], request_id="two",
                outputs=[th.InferRequestedOutput("outputs", binary_data=False)])
    assert r.get_response()["id"] == "two"
    np.testing.assert_allclose(r.as_numpy("outputs"), want[:2], atol=1e-2)


def test_http_kserve_bytes_bad_rows_alone(stack: Stack) -> None:
    """One-photo requests in flight together: each bad one 400 naming row 0 and why, the good ones scored; a bad
    photo among good ones in one request fails it naming its row."""
    from tritonclient.utils import InferenceServerException

    good, bad = good_rows(), bad_rows()
    want = reference(good)
    c = stack.http.client(concurrency=8)
    pending = [(name, c.async_infer("nsfw_photo", [_bytes_input([data])])) for name, (data, _why) in bad.items()]
    pending += [(f"good{k}", c.async_infer("nsfw_photo", [_bytes_input([data])])) for k, data in enumerate(good)]
    for name, call in pending:
        if name.startswith("good"):
            np.testing.assert_allclose(call.get_result().as_numpy("outputs")[0], want[int(name[4:])], atol=1e-2)
            continue
        with pytest.raises(InferenceServerException) as info:
            call.get_result()
        assert info.value.status() == "400", (name, info.value)
        text = info.value.message()
        assert "BAD_IMAGE" in text and "row 0" in text and bad[name][1] in text, (name, text)
    with pytest.raises(InferenceServerException, match=r"row 2: corrupt or truncated JPEG"):
        c.infer("nsfw_photo", [_bytes_input([good[0], good[1], bad["truncated"][0]])])
    with pytest.raises(InferenceServerException, match=r"inputs\[0\] element 1: an image of 1048577 bytes; model "
                                                       r"'nsfw_photo' takes 1\.\.1048576 bytes an image \(the "
                                                       r"broker's models\.nsfw_photo\.max_image_bytes\)"):
        c.infer("nsfw_photo", [_bytes_input([good[0], bytes(MAX_BYTES + 1)])])


def _kserve_body(elements: bytes, shape: list[int], size: int | None = None, datatype: str = "BYTES") -> tuple[
        bytes, dict[str, str]]:
    head = msgspec.json.encode({"inputs": [{"name": IMAGE_INPUT, "datatype": datatype, "shape": shape,
                                            "parameters": {"binary_data_size": len(elements) if size is None
                                                           else size}}]})
    return head + elements, {"Inference-Header-Content-Length": str(len(head)),
                             "Content-Type": "application/octet-stream"}


@pytest.mark.parametrize(("elements", "shape", "datatype", "expected"), [
    (struct.pack("<I", 50) + bytes(10), [1], "BYTES", "inputs[0] element 0: a length of 50 bytes, but only 10"),
    (struct.pack("<I", 0), [1], "BYTES", "inputs[0] element 0: an image of 0 bytes"),
    (struct.pack("<I", 3) + b"abc", [2], "BYTES", "ends inside element 1's length"),
    (struct.pack("<I", 3) + b"abcdef", [1], "BYTES", "binary_data_size: 10 bytes, but its 1 elements take 7"),
    (struct.pack("<I", 3) + b"abc", [1, 3], "BYTES", "inputs[0].shape: expected [N] or [N, 1]"),
    (struct.pack("<I", 3) + b"abc", [5], "BYTES", "inputs[0].shape[0]: expected 1..4 images"),
    (b"abc", [3], "UINT8", "inputs[0].datatype: expected 'BYTES'"),
], ids=["short", "empty", "missing", "extra", "shape", "rows", "datatype"])
def test_http_kserve_bytes_malformed(stack: Stack, elements: bytes, shape: list[int], datatype: str,
                                     expected: str) -> None:
    body, headers = _kserve_body(elements, shape, datatype=datatype)
    status, _h, data = stack.http.raw("POST", "/v2/models/nsfw_photo/infer", body, headers)
    assert status == 400 and expected in json.loads(data)["error"], data


# -- the inline gateway: one frame per image ------------------------------------------------------------------


def _inline_request(rid: int, images: list[bytes], shape: list[int] | None = None) -> list[bytes]:
    head = {"id": rid, "model": "nsfw_photo",
            "inputs": [{"name": IMAGE_INPUT, "dtype": "uint8", "shape": shape or [len(images)]}]}
    return [inline_envelope(MsgKind.INLINE_REQUEST), msgspec.json.encode(head), *images]


def test_inline_photos_bad_rows_alone(stack: Stack) -> None:
    """All in flight on one DEALER: each bad photo BAD_IMAGE naming row 0 and why, the good ones OK with the
    reference's scores, several photos a request; a bad photo among good ones names its row; a photo over
    max_image_bytes BAD_SIZE naming it; a shape not [N], or frames not one per image, refused."""
    good, bad = good_rows(), bad_rows()
    want = reference(good)
    sent: dict[int, str] = {}
    with inline_dealer(stack.inline) as sock:
        for k, (name, (data, _why)) in enumerate(bad.items()):
            sock.send_multipart(_inline_request(100 + k, [data]))
            sent[100 + k] = name
            sock.send_multipart(_inline_request(200 + k, [good[k % 3]]))
            sent[200 + k] = f"good{k % 3}"
        sock.send_multipart(_inline_request(300, good))
        sock.send_multipart(_inline_request(301, [good[0], good[1], bad["corrupt"][0]]))
        sock.send_multipart(_inline_request(302, [good[0], bytes(MAX_BYTES + 1)]))
        sock.send_multipart(_inline_request(303, [good[0]], shape=[1, 1]))
        sock.send_multipart(_inline_request(304, [good[0]], shape=[2]))
        replies: dict[int, tuple[dict[str, Any], list[bytes]]] = {}
        for _ in range(len(sent) + 5):
            assert sock.poll(120_000), f"{len(replies)} replies came"
            frames = sock.recv_multipart()
            assert frames[0] == inline_envelope(MsgKind.INLINE_REPLY)
            head = msgspec.json.decode(frames[1])
            replies[head["id"]] = (head, frames[2:])
        for rid, name in sent.items():
            head, outs = replies[rid]
            if name.startswith("good"):
                assert head["status"] == "OK", head
                got = np.frombuffer(outs[0], np.float32).reshape(head["outputs"][0]["shape"])
                np.testing.assert_allclose(got[0], want[int(name[4:])], atol=1e-2)
            else:
                assert head["status"] == "BAD_IMAGE", (name, head)
                assert "row 0" in head["message"] and bad[name][1] in head["message"], (name, head)
        head, outs = replies[300]
        assert head["status"] == "OK" and head["outputs"][0]["shape"] == [3, 2], head
        np.testing.assert_allclose(np.frombuffer(outs[0], np.float32).reshape(3, 2), want, atol=1e-2)
        assert replies[301][0]["status"] == "BAD_IMAGE" and "row 2: corrupt" in replies[301][0]["message"]
        assert replies[302][0]["status"] == "BAD_SIZE", replies[302][0]
        assert (f"inputs['{IMAGE_INPUT}'][1]: an image of {MAX_BYTES + 1} bytes; model 'nsfw_photo' takes "
                f"1..{MAX_BYTES} bytes an image (the broker's models.nsfw_photo.max_image_bytes)"
                in replies[302][0]["message"]), replies[302][0]
        assert replies[303][0]["status"] == "BAD_SHAPE" and "expected [N], N images" in replies[303][0]["message"]
        assert replies[304][0]["status"] == "BAD_MESSAGE" and "one per image" in replies[304][0]["message"]
        models = _inline_models(sock)
    assert models["nsfw_photo"]["inputs"][0]["kind"] == "image"


def _inline_models(sock: zmq.Socket[bytes]) -> dict[str, Any]:
    sock.send_multipart([inline_envelope(MsgKind.INLINE_MODELS), b"{}"])
    assert sock.poll(60_000)
    frames = sock.recv_multipart()
    return {m["name"]: m for m in msgspec.json.decode(frames[1])["models"]}


def test_inline_rows_limit_of_photos(stack: Stack) -> None:
    """More photos than max_batch: BAD_SHAPE naming the model's limit, before anything is copied."""
    with inline_dealer(stack.inline) as sock:
        sock.send_multipart(_inline_request(9, [b"\xff\xd8\xff"] * 5))
        (head,) = inline_replies(sock, 1)
    assert head["id"] == 9 and head["status"] == "BAD_SHAPE", head
    assert "model 'nsfw_photo' has max_batch 4" in head["message"], head


# -- the C client: image files as rows, its own ring or inline -------------------------------------------------


@pytest.fixture(scope="module")
def c_client(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not have_libzmq():
        pytest.skip("needs a C compiler and libzmq3-dev (.ci/run installs them)")
    return build_c_client(tmp_path_factory.mktemp("cbuild"))


@pytest.mark.parametrize("mode", ["shm", "inline"])
def test_c_client_photos_bad_rows_alone(stack: Stack, c_client: Path, tmp_path: Path, mode: str) -> None:
    """One C process per file, all at once: each bad photo fails (exit 3) with BAD_IMAGE naming row 0 and why, the
    good ones print the reference's scores; a request of several files prints a row each, or names its bad row;
    a file over max_image_bytes is refused by the broker's side naming the setting."""
    good, bad = good_rows(), bad_rows()
    want = reference(good)
    files: dict[str, Path] = {}
    for name, data in [*((n, d) for n, (d, _w) in bad.items()), *((f"good{k}", d) for k, d in enumerate(good)),
                       ("huge", bytes(MAX_BYTES + 1))]:
        files[name] = tmp_path / f"{name.replace(' ', '_')}.img"
        files[name].write_bytes(data)
    env = dict(os.environ, SHMBROKER_RUNTIME_DIR=str(stack.broker.runtime_dir))
    flag = ["--inline"] if mode == "inline" else []
    runs = {name: [str(path)] for name, path in files.items()}
    runs["all good"] = [str(files[f"good{k}"]) for k in range(3)]
    runs["one bad"] = [str(files["good0"]), str(files["not an image"]), str(files["good1"])]
    procs = {name: subprocess.Popen([str(c_client), *flag, "nsfw_photo", *paths], env=env, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE) for name, paths in runs.items()}
    done = {}
    try:
        for name, proc in procs.items():
            out, err = proc.communicate(timeout=120)
            done[name] = (proc.returncode, out, err)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
    bad_status = "BAD_IMAGE" if mode == "inline" else f"status {int(P.Status.BAD_IMAGE)}"
    for name, (_data, why) in bad.items():
        rc, _out, err = done[name]
        assert rc == 3 and bad_status in err and "row 0" in err and why in err, (name, rc, err)
    for k in range(3):
        rc, out, err = done[f"good{k}"]
        assert rc == 0, err
        np.testing.assert_allclose(np.array(out.split(), np.float32), want[k], atol=1e-2)
    rc, out, err = done["all good"]
    assert rc == 0, err
    np.testing.assert_allclose(np.array([line.split() for line in out.splitlines()], np.float32), want, atol=1e-2)
    rc, _out, err = done["one bad"]
    assert rc == 3 and "row 1: not a JPEG or PNG" in err, err
    rc, _out, err = done["huge"]
    size_status = "BAD_SIZE" if mode == "inline" else f"status {int(P.Status.BAD_SIZE)}"
    assert rc == 3 and size_status in err and "models.nsfw_photo.max_image_bytes" in err, err
