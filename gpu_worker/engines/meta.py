"""Model metadata shared by the GPU engines: IOSpecs from raw dimensions, and the JSON sidecar of a model file.

A sidecar is ``<model file>.json`` next to the model (``nsfw.plan.json``, ``net.pt.json``). Its ``inputs`` and
``outputs`` are lists of ``{"name": str, "dtype": numpy dtype name, "shape": [-1, d1, ...]}``; a TensorRT plan's
sidecar (written by ``shmbroker build``) also has ``tensorrt_version``, ``gpu_name``, ``compute_capability``,
``precision``, ``profiles``, ``onnx_sha256`` and ``flags``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import numpy as np

from gpu_worker.engines.base import EngineError, IOSpec
from gpu_worker.engines.onnxruntime import _ORT_TYPES, _spec

_TYPE_NAMES = {dtype: name for name, dtype in _ORT_TYPES.items()}


def spec_from_dims(name: str, dtype: np.dtype[Any], dims: Sequence[int | str | None], role: str) -> IOSpec:
    """The IOSpec of one tensor: ``dims[0]`` must be dynamic (-1, None or a symbol), the rest fixed and positive.

    The checks and their messages are the ONNX Runtime engine's, so every engine refuses the same models alike.
    """
    type_name = _TYPE_NAMES.get(np.dtype(dtype))
    if type_name is None:
        raise EngineError(f"{role} {name!r} has type {np.dtype(dtype)}, which shmbroker does not carry")
    shape = ["N" if d is None or (isinstance(d, int) and d < 0) else d for d in dims]
    return _spec(SimpleNamespace(name=name, type=type_name, shape=shape), role)


def sidecar_path(model_path: str) -> str:
    """Where the sidecar of ``model_path`` lives."""
    return model_path + ".json"


def read_sidecar(model_path: str) -> dict[str, Any] | None:
    """The parsed sidecar of ``model_path``, or None when there is none; EngineError when it is unreadable."""
    path = sidecar_path(model_path)
    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError) as exc:
        raise EngineError(f"model sidecar {path}: cannot read it: {exc}") from exc
    if not isinstance(data, dict):
        raise EngineError(f"model sidecar {path}: expected a JSON object, got {type(data).__name__}")
    return data


def specs_from_json(entries: Any, role: str, where: str) -> list[IOSpec]:
    """IOSpecs from a sidecar's ``inputs`` or ``outputs`` list; EngineError names the faulty entry."""
    if not isinstance(entries, list) or not entries:
        raise EngineError(f"{where}: '{role}s' must be a non-empty list of {{name, dtype, shape}}")
    specs = []
    for k, entry in enumerate(entries):
        try:
            name, dtype, shape = entry["name"], np.dtype(entry["dtype"]), entry["shape"]
        except (KeyError, TypeError) as exc:
            raise EngineError(f"{where}: {role}s[{k}] needs name, dtype and shape ({exc})") from exc
        if not isinstance(name, str) or not isinstance(shape, list) or not all(isinstance(d, int) for d in shape):
            raise EngineError(f"{where}: {role}s[{k}] needs a string name and a list of integer dimensions")
        specs.append(spec_from_dims(name, dtype, shape, role))
    return specs
