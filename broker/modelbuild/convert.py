"""Precision at the ONNX level, the same for TensorRT 10 and 11 (which take precision from the graph's types):
FP16 by converting the model's types with onnxconverter-common, INT8 by symmetric Q/DQ nodes inserted by
onnxruntime's ``quantize_static`` from calibration data. Both keep float32 inputs and outputs, so the converted
models take the same feeds as the original and run in ONNX Runtime on the CPU."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from shmbroker.broker.modelbuild.args import CALIB_METHODS
from shmbroker.broker.modelbuild.calibration import Data, batches

log = logging.getLogger(__name__)

# Kept in float32 in both conversions: their range or accumulation overflows fp16 or loses too much in int8.
SENSITIVE_OPS = (
    "Softmax", "LogSoftmax", "ReduceMean", "ReduceSum", "ReduceSumSquare", "ReduceL2", "ReduceLogSumExp",
    "ReduceProd", "LayerNormalization", "InstanceNormalization", "GroupNormalization", "Exp", "Log", "Pow",
)
# per-channel Q/DQ axes need opset 13; older models are converted up first
_QDQ_OPSET = 13


class ConversionError(RuntimeError):
    """A model that the conversion tools refuse, or whose result fails its check."""


def to_fp16(src: str, dst: str) -> None:
    """Write ``src`` with float16 weights and activations to ``dst``; float32 IO (``keep_io_types``), the ops of
    SENSITIVE_OPS and onnxconverter-common's own block list stay float32."""
    from onnxconverter_common import float16

    model = onnx.load(src)
    blocked = sorted(set(float16.DEFAULT_OP_BLOCK_LIST) | set(SENSITIVE_OPS))
    with warnings.catch_warnings(record=True) as caught:
        # it warns once per weight clamped into fp16's range (tiny ones flushed to 1e-7): a count is enough
        warnings.simplefilter("always")
        try:
            converted = float16.convert_float_to_float16(model, keep_io_types=True, op_block_list=blocked)
        except (ValueError, RuntimeError) as exc:
            raise ConversionError(f"onnxconverter-common cannot convert {src} to fp16: {exc}") from exc
    _float32_outputs(model, converted)
    clamped = sum("truncated" in str(w.message) for w in caught)
    if clamped:
        log.info("fp16: %d weights were outside fp16's range and were clamped", clamped)
    onnx.save(converted, dst)
    log.info("fp16 model written to %s", dst)


def _float32_outputs(original: onnx.ModelProto, converted: onnx.ModelProto) -> None:
    """Give back float32 to every output that was float32 before conversion.

    onnxconverter-common (1.16) casts a blocked node's result to fp16 even when it is a graph output and
    keep_io_types is set (the nsfw model's final Softmax): such an output gets a Cast back to float32.
    """
    was_float = {o.name for o in original.graph.output if o.type.tensor_type.elem_type == onnx.TensorProto.FLOAT}
    for out in converted.graph.output:
        if out.name not in was_float or out.type.tensor_type.elem_type != onnx.TensorProto.FLOAT16:
            continue
        inner = f"{out.name}_fp16"
        for node in converted.graph.node:
            node.output[:] = [inner if o == out.name else o for o in node.output]
            node.input[:] = [inner if i == out.name else i for i in node.input]
        converted.graph.node.append(
            onnx.helper.make_node("Cast", [inner], [out.name], to=onnx.TensorProto.FLOAT, name=f"{inner}_to_fp32"))
        out.type.tensor_type.elem_type = onnx.TensorProto.FLOAT


def _prepared(src: str, work: Path) -> str:
    """``src`` at opset >= 13, shape-inferred and with every node named (nodes_to_exclude goes by name)."""
    from onnx import version_converter
    from onnxruntime.quantization.shape_inference import quant_pre_process

    model = onnx.load(src)
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), _QDQ_OPSET)
    if opset < _QDQ_OPSET:
        log.info("%s has opset %d; converting to %d for per-channel Q/DQ", src, opset, _QDQ_OPSET)
        model = version_converter.convert_version(model, _QDQ_OPSET)
    upgraded, prepared = work / "upgraded.onnx", work / "prepared.onnx"
    onnx.save(model, str(upgraded))
    # symbolic shape inference needs sympy, which nothing else here needs; ONNX's own inference suffices
    quant_pre_process(str(upgraded), str(prepared), skip_symbolic_shape=True)
    model = onnx.load(str(prepared))
    for k, node in enumerate(model.graph.node):
        if not node.name:
            node.name = f"{node.op_type}_{k}"
    onnx.save(model, str(prepared))
    return str(prepared)


def _reader(data: Data, batch: int, advance: Callable[[int], None] | None) -> object:
    from onnxruntime.quantization import CalibrationDataReader

    class Reader(CalibrationDataReader):  # type: ignore[misc]  # untyped base from onnxruntime
        """Feeds ``data`` batch by batch and moves the progress bar by each batch's rows."""

        def __init__(self) -> None:
            self._it: Iterator[Data] = batches(data, batch)

        def get_next(self) -> Data | None:
            item = next(self._it, None)
            if item is not None and advance is not None:
                advance(len(next(iter(item.values()))))
            return item

    return Reader()


def to_int8(
    src: str, dst: str, data: Data, *, method: str = "entropy", batch: int = 8,
    advance: Callable[[int], None] | None = None,
) -> None:
    """Write ``src`` with symmetric INT8 Q/DQ nodes to ``dst``, calibrated on ``data`` by ``method``.

    Per-channel weights, symmetric activations and weights (every zero point 0, as TensorRT's parser needs),
    bias left in float (QuantizeBias off), SENSITIVE_OPS unquantized. ``advance(rows)`` follows calibration.
    """
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    methods = {"entropy": CalibrationMethod.Entropy, "minmax": CalibrationMethod.MinMax,
               "percentile": CalibrationMethod.Percentile}
    if method not in methods:
        raise ConversionError(f"--calib-method {method!r}: expected one of {', '.join(CALIB_METHODS)}")
    with tempfile.TemporaryDirectory(prefix="shmb-int8-") as tmp:
        prepared = _prepared(src, Path(tmp))
        keep = [n.name for n in onnx.load(prepared).graph.node if n.op_type in SENSITIVE_OPS]
        # onnxruntime prints its calibration steps to stdout, which belongs to the command's figures
        options = {"ActivationSymmetric": True, "WeightSymmetric": True, "QuantizeBias": False}
        try:
            with contextlib.redirect_stdout(sys.stderr):
                quantize_static(
                    prepared, dst, _reader(data, batch, advance), quant_format=QuantFormat.QDQ, per_channel=True,
                    activation_type=QuantType.QInt8, weight_type=QuantType.QInt8,
                    calibrate_method=methods[method], nodes_to_exclude=keep, extra_options=options,
                )
        except (ValueError, RuntimeError) as exc:
            raise ConversionError(f"onnxruntime cannot quantize {src}: {exc}") from exc
    log.info("int8 model written to %s (%s calibration)", dst, method)


@dataclasses.dataclass(frozen=True)
class QdqSummary:
    """What a Q/DQ model holds: node counts, how many zero points, which are not 0, per-channel weights."""

    quantize: int
    dequantize: int
    zero_points: int
    nonzero_zero_points: list[str]
    per_channel: int
    int32_bias: int

    def problems(self) -> list[str]:
        """Why TensorRT would refuse or mis-build this as an INT8 model; empty when it is fine."""
        found = []
        if not self.quantize or not self.dequantize:
            found.append("no QuantizeLinear/DequantizeLinear nodes: the model is not quantized")
        if self.nonzero_zero_points:
            found.append(f"zero points not 0 (TensorRT accepts only symmetric): {self.nonzero_zero_points[:5]}")
        return found


def qdq_summary(path: str) -> QdqSummary:
    """Count the Q/DQ nodes of the model at ``path`` and read every zero point it has."""
    model = onnx.load(path)
    inits = {i.name: i for i in model.graph.initializer}
    counts = {"QuantizeLinear": 0, "DequantizeLinear": 0}
    zps: dict[str, np.ndarray] = {}
    per_channel = int32_bias = 0
    for node in model.graph.node:
        if node.op_type not in counts:
            continue
        counts[node.op_type] += 1
        if len(node.input) > 2 and node.input[2] in inits:
            zps[node.input[2]] = numpy_helper.to_array(inits[node.input[2]])
        if node.op_type == "DequantizeLinear" and node.input[0] in inits:
            weight = inits[node.input[0]]
            per_channel += int(numpy_helper.to_array(inits[node.input[1]]).size > 1) if node.input[1] in inits else 0
            int32_bias += int(weight.data_type == onnx.TensorProto.INT32)
    nonzero = sorted(name for name, zp in zps.items() if np.any(zp != 0))
    return QdqSummary(counts["QuantizeLinear"], counts["DequantizeLinear"], len(zps), nonzero, per_channel,
                      int32_bias)


def fp16_summary(path: str) -> tuple[int, int]:
    """(float16 initializers, float32 initializers) of the model at ``path``."""
    model = onnx.load(path)
    kinds = [i.data_type for i in model.graph.initializer]
    return kinds.count(onnx.TensorProto.FLOAT16), kinds.count(onnx.TensorProto.FLOAT)
