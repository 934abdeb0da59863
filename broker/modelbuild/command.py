"""``shmbroker build`` and ``shmbroker check-precision``: arguments, progress bars and the written record.

Exit statuses of build: 0 plan or package built; 3 the engine's builder is missing (the message says what to
install: for tensorrt, the converted ONNX model was still written and checked; for inductor, PyTorch with CUDA
and Triton); 2 a bad option or unusable data; 1 a conversion or build that failed.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

from rich.progress import Progress

from shmbroker.broker.modelbuild import calibration, convert, engine, inductor
from shmbroker.broker.modelbuild.calibration import DataError
from shmbroker.broker.modelbuild.checks import check_converted, parse_profiles, row_digests
from shmbroker.broker.modelbuild.progress import bar, stages, stderr
from shmbroker.gpu_worker.engines.base import EngineError

log = logging.getLogger(__name__)

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_NO_BUILDER = 0, 1, 2, 3


def _say(text: str) -> None:
    sys.stderr.write(text + "\n")  # plain: rich would wrap the install command at the terminal's width


def _options(args: argparse.Namespace, model: str) -> engine.BuildOptions:
    for name, value, low in (("--streams", args.streams, 1), ("--workspace", args.workspace, 1),
                             ("--max-batch", args.max_batch, 1)):
        if value < low:
            raise DataError(f"{name} must be at least {low}, got {value}")
    if args.precision == "int8" and not args.calib_data:
        raise DataError("--precision int8 needs --calib-data (an image folder, a .npy or a .npz file)")
    return engine.BuildOptions(
        shapes=parse_profiles(args.profile, model, args.max_batch), streams=args.streams,
        workspace_mib=args.workspace, timing_cache=args.timing_cache,
        version_compatible=args.version_compatible, hardware_compat=args.hardware_compat)


def _convert(args: argparse.Namespace, out: Path, record: dict[str, Any]) -> str:
    """The model at the requested precision (the source itself for fp32); fills record's conversion fields."""
    src, stem = args.model, Path(args.model).stem
    if args.precision == "fp32":
        return str(src)
    dst = str(out / f"{stem}.{args.precision}.onnx")
    sample: calibration.Data | None = None
    if args.calib_data:
        total = _count(args.calib_data)
        with bar("calibration data", total) as advance:
            sample = calibration.load(args.calib_data, src, args.preprocess, advance)
        record["calibration"] = {"source": args.calib_data, "rows": calibration.rows(sample),
                                 "method": args.calib_method, "row_sha256": row_digests(sample)}
    if args.precision == "fp16":
        convert.to_fp16(src, dst)
    else:
        if sample is None:
            raise DataError("--precision int8 needs --calib-data")
        with bar(f"int8 calibration ({args.calib_method})", calibration.rows(sample)) as advance:
            convert.to_int8(src, dst, sample, method=args.calib_method, advance=advance)
    record["converted"] = {"path": Path(dst).name, "sha256": engine.sha256(dst),
                           "check": check_converted(src, dst, args.precision, sample)}
    return dst


def _count(source: str) -> int | None:
    path = Path(source)
    return len(calibration.image_files(path)) if path.is_dir() else None


def record_path(out: Path, source: str, precision: str) -> Path:
    """The build record: ``OUT/<stem>.<precision>.build.json``, beside ``<stem>.<precision>.onnx``."""
    return out / f"{Path(source).stem}.{precision}.build.json"


def _write_record(out: Path, record: dict[str, Any]) -> None:
    path = record_path(out, record["source"], record["precision"])
    path.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")


def _build_engine(args: argparse.Namespace, out: Path, model: str, options: engine.BuildOptions,
                  record: dict[str, Any]) -> int:
    try:
        trt = engine.import_builder()
    except engine.BuilderMissing as exc:
        record["tensorrt"] = {"status": "missing", "reason": str(exc)}
        _say(f"shmbroker build: no TensorRT plan: {exc}")
        _say(f"shmbroker build: the {args.precision} ONNX model is ready: {model} (ONNX Runtime or PyTorch serve it)")
        return EXIT_NO_BUILDER
    plan = out / f"{Path(args.model).stem}.{args.precision}.plan"
    with Progress(console=stderr) as progress:
        tasks: dict[str, Any] = {}

        def advance(phase: str, step: int, steps: int) -> None:
            task = tasks.setdefault(phase, progress.add_task(phase, total=steps))
            progress.update(task, completed=step)

        version, capability, gpu = engine.build_plan(trt, model, str(plan), options, advance)
    from shmbroker.gpu_worker.engines.onnxruntime import OnnxRuntimeEngine

    ort_model = OnnxRuntimeEngine(model, intra_op_threads=1)
    io = {k: [{"name": s.name, "dtype": s.dtype.name, "shape": list(s.shape)} for s in specs]
          for k, specs in (("inputs", ort_model.inputs), ("outputs", ort_model.outputs))}
    sidecar = engine.make_sidecar(onnx_path=model, source_sha256=record["onnx_sha256"], precision=args.precision,
                                  options=options, io=io, tensorrt_version=version, gpu_name=gpu,
                                  capability=capability)
    Path(f"{plan}.json").write_text(json.dumps(sidecar, indent=2) + "\n", encoding="utf-8")
    record["tensorrt"] = {"status": "built", "plan": plan.name, "sidecar": sidecar}
    _say(f"shmbroker build: plan {plan} ({version}, {gpu})")
    return EXIT_OK


def batch_sizes(text: str) -> tuple[int, ...]:
    """``--batch-sizes 1,8,32`` as sorted unique sizes; DataError names the option."""
    try:
        sizes = tuple(sorted({int(p) for p in text.split(",") if p.strip()}))
    except ValueError:
        sizes = ()
    if not sizes or not all(1 <= s <= 4096 for s in sizes):
        raise DataError(f"--batch-sizes {text!r}: expected comma-separated batch sizes in 1..4096, e.g. 1,8,32")
    return sizes


def _inductor_options(args: argparse.Namespace) -> inductor.InductorOptions:
    if args.precision not in inductor.PRECISIONS:
        raise DataError(f"--precision {args.precision} is for --engine tensorrt; --engine inductor builds "
                        f"{' or '.join(inductor.PRECISIONS)}")
    return inductor.InductorOptions(precision=args.precision, batch_sizes=batch_sizes(args.batch_sizes),
                                    dynamic=args.dynamic_batch, autotune=args.autotune == "max",
                                    cache_dir=str(Path(args.cache_dir or inductor.default_cache_dir()).resolve()))


def _build_inductor(args: argparse.Namespace) -> int:
    """``shmbroker build --engine inductor``: the AOTInductor package and its sidecar, no ONNX conversion."""
    options = _inductor_options(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record: dict[str, Any] = {"source": str(args.model), "onnx_sha256": engine.sha256(args.model),
                              "precision": args.precision, "engine": "inductor"}
    record_file = inductor.package_path(out, args.model, args.precision).with_suffix(".build.json")
    try:
        with stages(f"inductor {args.precision}", options.stage_count()) as stage:
            path, sidecar = inductor.build_package(args.model, out, options, stage, record["onnx_sha256"])
    except engine.BuilderMissing as exc:
        record["inductor"] = {"status": "missing", "reason": str(exc)}
        record_file.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
        _say(f"shmbroker build: no inductor package: {exc}")
        return EXIT_NO_BUILDER
    except EngineError as exc:  # onnx2torch could not read or convert the model
        raise engine.BuildError(str(exc)) from exc
    Path(f"{path}.json").write_text(json.dumps(sidecar, indent=2) + "\n", encoding="utf-8")
    record["inductor"] = {"status": "built", "package": path.name, "sidecar": sidecar}
    record_file.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    secs = sidecar["build_seconds"]
    _say(f"shmbroker build: package {path} ({sidecar['precision']}, batch {sidecar['batch']['mode']} "
         f"{'/'.join(sidecar['batch']['models'])}; torch {sidecar['torch_version']}, {sidecar['gpu_name']}; "
         f"build {sum(secs.values()):.0f} s: {', '.join(f'{k} {v:g} s' for k, v in secs.items())})")
    return EXIT_OK


def cmd_build(args: argparse.Namespace) -> int:
    """``shmbroker build``: convert, check, then build the plan (or the inductor package) when its builder is
    installed."""
    if args.engine == "inductor":
        try:
            return _build_inductor(args)
        except (DataError, OSError) as exc:
            _say(f"shmbroker build: {exc}")
            return EXIT_USAGE
        except engine.BuildError as exc:
            _say(f"shmbroker build: {exc}")
            return EXIT_FAILED
    out = Path(args.out)
    try:
        options = _options(args, args.model)
        out.mkdir(parents=True, exist_ok=True)
        record: dict[str, Any] = {"source": str(args.model), "onnx_sha256": engine.sha256(args.model),
                                  "precision": args.precision, "flags": options.flags(), "streams": options.streams,
                                  "profile": {k: [list(s) for s in v] for k, v in options.shapes.items()}}
        model = _convert(args, out, record)
        problems = record.get("converted", {}).get("check", {}).get("problems", [])
        if problems:
            _write_record(out, record)
            _say(f"shmbroker build: the {args.precision} model fails its check: {'; '.join(problems)}")
            return EXIT_FAILED
        try:
            rc = _build_engine(args, out, model, options, record)
        finally:
            _write_record(out, record)
    except (DataError, OSError) as exc:
        _say(f"shmbroker build: {exc}")
        return EXIT_USAGE
    except (convert.ConversionError, engine.BuildError) as exc:
        _say(f"shmbroker build: {exc}")
        return EXIT_FAILED
    return rc
