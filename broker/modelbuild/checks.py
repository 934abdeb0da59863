"""The checks around a build: --profile parsing, the converted model's own check, and ``check-precision``
(a converted model against the float32 one on evaluation data that must not be the calibration data)."""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import sys
from pathlib import Path
from typing import Any

import numpy as np

from shmbroker.broker.modelbuild import calibration, convert, precision
from shmbroker.broker.modelbuild.calibration import Data, DataError
from shmbroker.broker.modelbuild.progress import bar
from shmbroker.gpu_worker.engines.base import EngineError

log = logging.getLogger(__name__)

Shape = tuple[int, ...]
_CHECK_ROWS = 32  # rows of calibration data the build compares on: a smoke check, check-precision is the real one


def _shape(text: str, dims: list[int | str], name: str) -> Shape:
    if "x" not in text:  # a batch size: the other dimensions are the model's fixed ones
        rest = dims[1:]
        if not all(isinstance(d, int) and d > 0 for d in rest):
            raise DataError(f"--profile {name}: input has dynamic dims {dims}; give full shapes like 1x3x224x224")
        return (int(text), *(int(d) for d in rest))
    shape = tuple(int(p) for p in text.split("x"))
    if len(shape) != len(dims):
        raise DataError(f"--profile {name}: shape {text} has {len(shape)} dims, the input has {len(dims)}")
    return shape


def parse_profiles(specs: list[str], model: str, max_batch: int) -> dict[str, tuple[Shape, Shape, Shape]]:
    """(min, opt, max) per model input from ``--profile NAME:MIN,OPT,MAX`` (the name may hold ':', as in
    'input:0'); inputs without one get batch 1, max_batch, max_batch. DataError names the faulty option."""
    inputs = {name: dims for name, _, dims in calibration.model_inputs(model)}
    shapes: dict[str, tuple[Shape, Shape, Shape]] = {}
    for spec in specs:
        name, sep, ranges = spec.rpartition(":")
        parts = ranges.split(",")
        if not sep or name not in inputs or len(parts) != 3:
            raise DataError(f"--profile {spec!r}: expected NAME:MIN,OPT,MAX with NAME one of {sorted(inputs)}")
        try:
            low, opt, high = (_shape(p, inputs[name], name) for p in parts)
        except ValueError as exc:
            raise DataError(f"--profile {spec!r}: sizes must be integers or AxBxC shapes ({exc})") from exc
        if not all(0 < a <= b <= c for a, b, c in zip(low, opt, high, strict=True)):
            raise DataError(f"--profile {spec!r}: needs 0 < min <= opt <= max in every dimension")
        shapes[name] = (low, opt, high)
    for name, dims in inputs.items():
        if name not in shapes:
            low, high = _shape("1", dims, name), _shape(str(max_batch), dims, name)
            shapes[name] = (low, high, high)
    return shapes


def row_digests(data: Data) -> list[str]:
    """A short SHA-256 of each row (all inputs of the row together), to tell evaluation rows from calibration."""
    digests = []
    for k in range(calibration.rows(data)):
        h = hashlib.sha256()
        for name in sorted(data):
            h.update(np.ascontiguousarray(data[name][k]).tobytes())
        digests.append(h.hexdigest()[:16])
    return digests


def check_converted(src: str, dst: str, kind: str, sample: Data | None) -> dict[str, Any]:
    """What build records of a converted model: its Q/DQ or fp16 make-up, its problems, and (with calibration
    data) a comparison with the source on up to _CHECK_ROWS of those rows. ``problems`` empty means it passed."""
    found: dict[str, Any] = {}
    problems: list[str] = []
    if kind == "int8":
        summary = convert.qdq_summary(dst)
        found["qdq"] = {"quantize": summary.quantize, "dequantize": summary.dequantize,
                        "zero_points": summary.zero_points, "per_channel_weights": summary.per_channel}
        problems += summary.problems()
    else:
        half, single = convert.fp16_summary(dst)
        found["initializers"] = {"float16": half, "float32": single}
        if not half:
            problems.append("no float16 initializers: nothing was converted")
    if sample is not None:
        part = {k: v[:_CHECK_ROWS] for k, v in sample.items()}
        ref = precision.outputs(precision.session(src), part, 8)
        c = precision.compare(ref, precision.outputs(precision.session(dst), part, 8))
        found["on_calibration_rows"] = {"rows": c.rows, "argmax_agreement": c.argmax_agreement,
                                        "max_abs_diff": c.max_abs_diff, "mean_abs_diff": c.mean_abs_diff}
    found["problems"] = problems
    return found


def _calibration_overlap(candidate: str, digests: set[str]) -> int:
    """Rows of the evaluation data that the candidate's build record lists as calibration rows."""
    record = Path(candidate).with_suffix(".build.json")  # X.int8.onnx -> X.int8.build.json
    if not record.is_file():
        return 0
    try:
        rows = json.loads(record.read_text(encoding="utf-8")).get("calibration", {}).get("row_sha256", [])
    except (OSError, ValueError, AttributeError):
        log.warning("%s: unreadable build record, calibration overlap not checked", record)
        return 0
    return len(digests & set(rows))


def _evaluate(args: argparse.Namespace, data: Data) -> dict[str, Any]:
    models = [args.reference, *args.candidates]
    result: dict[str, Any] = {"rows": calibration.rows(data), "models": {}}
    ref_out: np.ndarray | None = None
    for path in models:
        sess = precision.open_model(path, args.threads)
        with bar(f"evaluating {Path(path).name}", calibration.rows(data)) as advance:
            out = precision.outputs(sess, data, args.batch, advance)
        entry: dict[str, Any] = {"rows_per_s": precision.throughput(sess, data, args.batch, args.seconds)}
        if ref_out is None:
            ref_out = out
        else:
            entry.update(vars(precision.compare(ref_out, out)))
        result["models"][path] = entry
    return result


def cmd_check_precision(args: argparse.Namespace) -> int:
    """``shmbroker check-precision``: exit 0 with the figures, 2 for unusable or overlapping data."""
    try:
        if args.batch < 1 or args.seconds <= 0:
            raise DataError(f"--batch must be >= 1 and --seconds > 0, got {args.batch} and {args.seconds}")
        data = calibration.load(args.eval_data, args.reference, args.preprocess)
        digests = set(row_digests(data))
        for candidate in args.candidates:
            overlap = _calibration_overlap(candidate, digests)
            if overlap:
                raise DataError(f"--eval-data: {overlap} of its rows calibrated {candidate} (its build record): "
                                "evaluate on data disjoint from the calibration set")
        result = _evaluate(args, data)
    except (DataError, OSError, EngineError) as exc:
        sys.stderr.write(f"shmbroker check-precision: {exc}\n")
        return 2
    if args.json:
        sys.stdout.write(json.dumps(result, indent=2) + "\n")
        return 0
    names = list(result["models"])
    comps = {n: precision.Comparison(**{k: v for k, v in e.items() if k != "rows_per_s"})
             for n, e in result["models"].items() if "rows" in e}
    rates = {n: e["rows_per_s"] for n, e in result["models"].items()}
    lines = precision.report_lines(names, comps, rates)
    engines = "ONNX Runtime CPU" + (", .pt2 on CUDA device 0" if any(n.endswith(".pt2") for n in names) else "")
    sys.stdout.write("\n".join([f"{result['rows']} evaluation rows, {engines}", *lines]) + "\n")
    return 0
