"""Issue 4 acceptance on the CPU: the nsfw model converted to fp16 and to int8 (calibrated on real photographs),
evaluated with onnxruntime on other photographs, and both converted models served through a real broker."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from shmbroker.broker.modelbuild import convert, precision
from shmbroker.client import Client
from tests import photoset
from tests.conftest import start_broker
from tests.models import NSFW

INPUT = "input:0"


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The fp32 original and its fp16 and int8 conversions (MinMax calibration on 24 calibration views)."""
    out = tmp_path_factory.mktemp("precision")
    calib_names, _ = photoset.split()
    paths = {"fp32": NSFW, "fp16": str(out / "nsfw.fp16.onnx"), "int8": str(out / "nsfw.int8.onnx")}
    convert.to_fp16(NSFW, paths["fp16"])
    calib = {INPUT: photoset.nsfw_rows(calib_names, 24, seed=1)}
    convert.to_int8(NSFW, paths["int8"], calib, method="minmax")
    return paths


@pytest.fixture(scope="module")
def evaluation() -> np.ndarray:
    _, eval_names = photoset.split()
    return photoset.nsfw_rows(eval_names, 64, seed=2)


@pytest.fixture(scope="module")
def outputs(models: dict[str, str], evaluation: np.ndarray) -> dict[str, np.ndarray]:
    return {k: precision.outputs(precision.session(p), {INPUT: evaluation}, 8) for k, p in models.items()}


def test_photo_sets_are_real_and_disjoint_by_photo() -> None:
    calib, evaluation = photoset.split()
    assert not set(calib) & set(evaluation)
    assert len(calib) >= 4 and len(evaluation) >= 8
    if os.environ.get("CI"):  # .ci/run installs mate-backgrounds: 30 photographs in all
        assert len(calib) + len(evaluation) >= 20, sorted(photoset.photos())


def test_fp16_is_within_001_of_fp32(models: dict[str, str], outputs: dict[str, np.ndarray]) -> None:
    half, single = convert.fp16_summary(models["fp16"])
    assert half > 50 and half > single  # the conv weights really are float16
    sess = precision.session(models["fp16"])
    assert [i.type for i in sess.get_inputs()] == ["tensor(float)"]  # keep_io_types: the same feeds as fp32
    c = precision.compare(outputs["fp32"], outputs["fp16"])
    assert c.rows == 64
    assert c.max_abs_diff <= 0.01, c


def test_int8_agrees_with_fp32(outputs: dict[str, np.ndarray]) -> None:
    c = precision.compare(outputs["fp32"], outputs["int8"])
    assert c.argmax_agreement >= 0.98, c
    assert c.mean_abs_diff <= 0.03, c
    assert c.max_abs_diff > 0.0  # it computes in int8, so it cannot be bit-identical to fp32


def test_int8_is_symmetric_qdq(models: dict[str, str]) -> None:
    model = onnx.load(models["int8"])
    ops = [n.op_type for n in model.graph.node]
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    convs = ops.count("Conv")
    assert ops.count("QuantizeLinear") >= convs and ops.count("DequantizeLinear") >= 2 * convs
    zero_points = [inits[n.input[2]] for n in model.graph.node
                   if n.op_type in ("QuantizeLinear", "DequantizeLinear") and len(n.input) > 2]
    assert len(zero_points) >= ops.count("QuantizeLinear")
    assert all(zp.dtype == np.int8 and not zp.any() for zp in zero_points)
    summary = convert.qdq_summary(models["int8"])
    assert summary.problems() == []
    assert summary.per_channel >= convs  # per-channel weight scales
    assert summary.int32_bias == 0  # QuantizeBias off
    softmax = next(n for n in model.graph.node if n.op_type == "Softmax")
    consumers = [n.op_type for n in model.graph.node if softmax.output[0] in n.input]
    assert "QuantizeLinear" not in consumers  # Softmax itself is left in float


def test_qdq_summary_flags_asymmetric_and_plain_models(tmp_path: Path) -> None:
    assert convert.qdq_summary(NSFW).problems() == [
        "no QuantizeLinear/DequantizeLinear nodes: the model is not quantized"]
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("QuantizeLinear", ["x", "s", "zp"], ["q"]),
         helper.make_node("DequantizeLinear", ["q", "s", "zp"], ["y"])],
        "asym", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])],
        initializer=[numpy_helper.from_array(np.array(0.1, np.float32), "s"),
                     numpy_helper.from_array(np.array(3, np.int8), "zp")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), str(tmp_path / "a.onnx"))
    problems = convert.qdq_summary(str(tmp_path / "a.onnx")).problems()
    assert len(problems) == 1 and "zero points not 0" in problems[0] and "'zp'" in problems[0]


@pytest.fixture(scope="module")
def converted_broker(models: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    cfg = "".join(
        f'\n[models.nsfw_{k}]\npath = "{models[k]}"\nmax_batch = 4\nmax_queue_delay_us = 2000\n'
        f"max_queue_size = 8\ntimeout_ms = 20000\n" for k in ("fp16", "int8"))
    b = start_broker(tmp_path_factory.mktemp("converted-broker"), "process", models=cfg)
    try:
        yield b.runtime_dir
    finally:
        assert b.stop() == 0, b.log()


@pytest.mark.parametrize("kind", ["fp16", "int8"])
def test_broker_serves_converted_model(kind: str, models: dict[str, str], evaluation: np.ndarray,
                                       converted_broker: Path) -> None:
    x = evaluation[:6]
    direct = ort.InferenceSession(models[kind], providers=["CPUExecutionProvider"]).run(None, {INPUT: x})[0]
    with Client(converted_broker) as c:
        served = np.concatenate([np.asarray(c.infer(f"nsfw_{kind}", x[k : k + 2])) for k in range(0, 6, 2)])
    assert served.dtype == np.float32 and served.shape == (6, 2)
    np.testing.assert_allclose(served, direct, atol=1e-5)
