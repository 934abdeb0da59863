"""bench.photo_inprocess: (a) runs the worker's own photo runner, built as the worker builds it, on real photos; its
rows are the preset's, a bad photo stops the measurement naming it, and a model that cannot load is the bench's
error."""

from __future__ import annotations

import io

import msgspec
import numpy as np
import pytest

from shmbroker.bench import photoset
from shmbroker.bench.common import BenchError, Progress
from shmbroker.bench.photo_inprocess import Limit, Shape, load_shape
from shmbroker.broker.common import config
from shmbroker.gpu_worker.photos import PRESETS, TurboDecoder

MODEL = "nsfw_photo"


def _jpegs(n: int) -> list[memoryview]:
    found = photoset.sources(strict=True)
    out = []
    for name in sorted(found)[:n]:
        with io.BytesIO() as buf:
            photoset.fit(found[name](), (320, 240)).save(buf, format="JPEG", quality=90)
            out.append(memoryview(buf.getvalue()))
    return out


def test_the_shape_decodes_rows_as_the_worker_does() -> None:
    cfg = config.load(config.DEFAULT_CONFIG)
    shape = load_shape(cfg, MODEL, 2, 1)
    try:
        assert isinstance(shape, Shape)  # a CPU worker's: the host runner
        assert shape.name == "2 instances x 1 thread" and len(shape.inputs) == 2
        photos = _jpegs(3)
        batch = shape.inputs[0]
        assert shape.runner.decode_rows(photos, batch, 0) is None
        decoder, preset = TurboDecoder("x"), PRESETS["opennsfw"]
        for k, data in enumerate(photos):
            want = preset.apply(decoder.decode(data, preset.decode_min, preset.decode_min, 10**8))
            np.testing.assert_array_equal(batch[k], want)
        error = shape.runner.decode_rows([photos[0], memoryview(b"not a photo")], batch, 0)
        assert error is not None and error.startswith("row 1: not a JPEG or PNG")
        assert shape.runner.feeds(batch, 3)["input:0"].shape == (3, 224, 224, 3)
    finally:
        shape.close()


def test_a_sweep_picks_a_measured_shape_and_batch_and_measures_it() -> None:
    cfg = config.load(config.DEFAULT_CONFIG)
    photos = _jpegs(4)
    with Limit(cfg, MODEL) as limit:
        assert limit.decoder.startswith("cpu:simplejpeg ")
        sizes = limit.batch_sizes((1, 4, 64))
        assert sizes == [1, 4, 8]  # capped at max_batch, which is always measured
        sweep = limit.sweep(photos, [1, 2], 0.01, Progress(io.StringIO()))
        assert sweep["best_batch"] in (1, 2) and sweep["best_shape"] in sweep["by_shape"]
        for by_batch in sweep["by_shape"].values():
            assert all(f["runs"] >= 3 and f["bound_by"] in ("decode", "engine") for f in by_batch.values())
        window = limit.measure(photos, 0.01)
        assert window["batch"] == sweep["best_batch"] and window["per_s"] > 0 and window["runs"] >= 3


def test_a_photo_that_does_not_decode_fails_the_window_naming_it() -> None:
    cfg = config.load(config.DEFAULT_CONFIG)
    shape = load_shape(cfg, MODEL, 1, 1)
    try:
        with pytest.raises(BenchError, match="does not decode: row 0: corrupt"):
            shape.window([memoryview(b"\xff\xd8\xff\xe0 truncated")], 1, 0.0, 1)
    finally:
        shape.close()


def test_an_engine_the_bench_cannot_load_is_its_error_naming_the_model() -> None:
    cfg = config.load(config.DEFAULT_CONFIG)
    model = msgspec.structs.replace(cfg.models[MODEL], engine="torch")
    gpu = msgspec.structs.replace(cfg, models={MODEL: model},
                                  worker=msgspec.structs.replace(cfg.worker, devices=["0"]))
    with pytest.raises(BenchError, match=f"model '{MODEL}'"):
        load_shape(gpu, MODEL, 1, 1)



def test_a_gpu_shape_needs_the_workers_device_runner() -> None:
    from shmbroker.bench.photo_device import device_shape
    from shmbroker.gpu_worker.photorunner import PhotoRunner

    with pytest.raises(BenchError, match="the worker's runner is a PhotoRunner, not a DevicePhotoRunner"):
        device_shape(PhotoRunner.__new__(PhotoRunner))
