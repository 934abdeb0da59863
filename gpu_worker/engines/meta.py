"""Model metadata shared by every engine: IOSpecs from ONNX types or raw dimensions, and a model file's JSON sidecar.

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

from shmbroker.gpu_worker.engines.base import EngineError, IOSpec

# ONNX tensor types as ONNX Runtime names them, and the NumPy dtypes that carry them
ONNX_TYPES: dict[str, np.dtype[Any]] = {
    "tensor(float)": np.dtype("float32"),
    "tensor(float16)": np.dtype("float16"),
    "tensor(double)": np.dtype("float64"),
    "tensor(int8)": np.dtype("int8"),
    "tensor(uint8)": np.dtype("uint8"),
    "tensor(int16)": np.dtype("int16"),
    "tensor(uint16)": np.dtype("uint16"),
    "tensor(int32)": np.dtype("int32"),
    "tensor(uint32)": np.dtype("uint32"),
    "tensor(int64)": np.dtype("int64"),
    "tensor(uint64)": np.dtype("uint64"),
    "tensor(bool)": np.dtype("bool"),
}


def spec_of(arg: Any, role: str) -> IOSpec:
    """The IOSpec of an ONNX graph input or output (``name``, ``type`` as "tensor(float)", ``shape``); EngineError
    for a type shmbroker does not carry or a shape that does not batch along a dynamic first dimension."""
    dtype = ONNX_TYPES.get(arg.type)
    if dtype is None:
        raise EngineError(f"{role} {arg.name!r} has type {arg.type}, which shmbroker does not carry")
    shape = list(arg.shape)
    if not shape:
        raise EngineError(f"{role} {arg.name!r} is a scalar; shmbroker needs a leading batch dimension")
    if isinstance(shape[0], int) and shape[0] > 0:
        raise EngineError(
            f"{role} {arg.name!r} has a fixed first dimension {shape[0]}; shmbroker batches along a dynamic one"
        )
    rest = shape[1:]
    if not all(isinstance(d, int) and d > 0 for d in rest):
        raise EngineError(f"{role} {arg.name!r} has dynamic dimensions {rest} after the batch dimension")
    return IOSpec(arg.name, dtype, (-1, *rest))


_TYPE_NAMES = {dtype: name for name, dtype in ONNX_TYPES.items()}


def spec_from_dims(name: str, dtype: np.dtype[Any], dims: Sequence[int | str | None], role: str) -> IOSpec:
    """The IOSpec of one tensor: ``dims[0]`` must be dynamic (-1, None or a symbol), the rest fixed and positive.

    The checks and their messages are ``spec_of``'s, so every engine refuses the same models alike.
    """
    type_name = _TYPE_NAMES.get(np.dtype(dtype))
    if type_name is None:
        raise EngineError(f"{role} {name!r} has type {np.dtype(dtype)}, which shmbroker does not carry")
    shape = ["N" if d is None or (isinstance(d, int) and d < 0) else d for d in dims]
    return spec_of(SimpleNamespace(name=name, type=type_name, shape=shape), role)


def onnx_specs(model: Any) -> tuple[list[IOSpec], list[IOSpec]]:
    """The inputs and outputs of a loaded ``onnx.ModelProto``; EngineError for IO shmbroker does not carry."""
    import onnx

    def spec(value: Any, role: str) -> IOSpec:
        ttype = value.type.tensor_type
        try:
            dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(ttype.elem_type))
        except (KeyError, TypeError, ValueError) as exc:
            raise EngineError(f"{role} {value.name!r} is not a tensor of a numpy type") from exc
        dims = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in ttype.shape.dim]
        return spec_from_dims(value.name, dtype, dims, role)

    initializers = {t.name for t in model.graph.initializer}  # IR < 4 lists them as inputs too
    inputs = [spec(v, "input") for v in model.graph.input if v.name not in initializers]
    return inputs, [spec(v, "output") for v in model.graph.output]


def onnx_file_specs(source: str | bytes) -> tuple[list[IOSpec], list[IOSpec]]:
    """The inputs and outputs of an ONNX file (or its bytes), read without running it; EngineError when unreadable."""
    import onnx

    where = "<model bytes>" if isinstance(source, bytes) else source
    try:
        model = (onnx.load_from_string(source) if isinstance(source, bytes)
                 else onnx.load(source, load_external_data=False))
    except Exception as exc:  # protobuf and IO errors alike
        raise EngineError(f"cannot read the ONNX model {where}: {exc}") from exc
    return onnx_specs(model)


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
