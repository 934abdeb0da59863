"""Where a model's bytes come from: a file, a package resource (``pkg:``) or a built-in model (``builtin:``)."""

from __future__ import annotations

import importlib.resources

import numpy as np

TINY_WIDTH = 256
TINY_SEED = 20261202


class ModelSourceError(ValueError):
    """A model path that names nothing loadable."""


def tiny_model_bytes(width: int = TINY_WIDTH, seed: int = TINY_SEED) -> bytes:
    """float32 [N, width] -> MatMul(fixed-seed weight) -> Relu -> float32 [N, width], built with onnx.helper."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    weight = (np.random.default_rng(seed).standard_normal((width, width)) / np.sqrt(width)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("Relu", ["h"], ["y"])],
        "tiny",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", width])],
        initializer=[numpy_helper.from_array(weight, "W")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], producer_name="shmbroker")
    model.ir_version = 8
    onnx.checker.check_model(model)
    data: bytes = model.SerializeToString()
    return data


BUILTINS = {"tiny": tiny_model_bytes}


def resolve(path: str) -> str | bytes:
    """A filesystem path (str) or the model's bytes, for ``path`` as written in the config."""
    if path.startswith("builtin:"):
        name = path.removeprefix("builtin:")
        if name not in BUILTINS:
            raise ModelSourceError(f"no built-in model {name!r}; built-ins are {sorted(BUILTINS)}")
        return BUILTINS[name]()
    if path.startswith("pkg:"):
        package, _, resource = path.removeprefix("pkg:").partition("/")
        try:
            ref = importlib.resources.files(package) / resource
        except ModuleNotFoundError:
            raise ModelSourceError(f"model path {path!r}: package {package!r} is not installed") from None
        if not ref.is_file():
            raise ModelSourceError(f"model path {path!r}: package {package!r} has no file {resource!r}")
        return str(ref)
    return path
