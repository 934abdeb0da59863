"""The image tables: the preprocessing presets a model may name (``models.NAME.preprocess``) and the decoders
that turn an image input's rows into pixels, one row each. Reading them loads no image library.

A decoder is one class (``gpu_worker/photos.py``, ``Decoder``) and one row here; a worker takes the first
decoder whose ``gpu`` matches its device. A GPU worker's is a stage that decodes and preprocesses a whole batch
on the device (``gpu_worker/devicephotos.py``, ``DevicePhotos``).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DecoderEntry:
    """One decoder: its name, its class as ``module:Class``, whether it runs on a GPU worker, a line of help."""

    name: str
    target: str
    gpu: bool
    summary: str

    def load_class(self) -> Any:
        module, _, attr = self.target.partition(":")
        return getattr(importlib.import_module(module), attr)


DECODERS: tuple[DecoderEntry, ...] = (
    DecoderEntry("libjpeg-turbo", "shmbroker.gpu_worker.photos:TurboDecoder", False,
                 "JPEG with libjpeg-turbo (simplejpeg), DCT-domain downscaling to the preset's size; PNG with Pillow"),
    DecoderEntry("nvjpeg", "shmbroker.gpu_worker.devicephotos:DevicePhotos", True,
                 "JPEG with nvJPEG (torchvision's decode_jpeg on CUDA, one call a batch), preprocessed on the GPU into "
                 "the engine's input; PNG and CMYK JPEG with Pillow on the worker's CPU, then uploaded"),
)

# name -> a line of help; the recipes are in gpu_worker/photos.py (PRESETS)
PRESETS: dict[str, str] = {
    "opennsfw": "open_nsfw's: 256x256 bilinear, centre crop 224, JPEG round trip, BGR minus the mean (104, 117, 123)",
    "imagenet": "ImageNet's: shorter side 256 bilinear, centre crop 224, RGB / 255, minus mean, over std",
}


def decoder_for(gpu: bool) -> DecoderEntry | None:
    """The decoder a worker of this kind uses, or None when none is built for it."""
    return next((d for d in DECODERS if d.gpu == gpu), None)


def presets_text() -> str:
    return ", ".join(repr(n) for n in PRESETS)
