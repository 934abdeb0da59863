"""``shmbroker build`` without the full TensorRT builder (as here and in CI): it says so and how to install it,
exits 3, and still writes and checks the converted ONNX model and the build record; ``check-precision`` on
disjoint photos; the plan sidecar both ways. The TensorRT build itself needs the builder and a GPU: untested."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shmbroker.broker import cli
from shmbroker.broker.modelbuild import calibration, convert, engine
from shmbroker.gpu_worker.engines import EngineError
from shmbroker.gpu_worker.engines.onnxruntime import OnnxRuntimeEngine
from shmbroker.gpu_worker.engines.tensorrt import check_plan_io, check_plan_meta
from shmbroker.gpu_worker.model_source import tiny_model_bytes
from tests import photoset
from tests.models import NSFW

INSTALL = "pip install tensorrt-cu13 --extra-index-url https://pypi.nvidia.com"


@pytest.fixture(autouse=True)
def no_builder(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # as on a machine without the full builder


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    calib_names, eval_names = photoset.split()
    root = tmp_path_factory.mktemp("photos")
    photoset.write_jpegs(root / "calib", calib_names, 8, seed=3)
    photoset.write_jpegs(root / "eval", eval_names, 12, seed=4)
    return root / "calib", root / "eval"


def test_int8_build_without_builder_then_check_precision(
        tmp_path: Path, folders: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    calib, evaluation = folders
    out = tmp_path / "out"
    rc = cli.main(["build", NSFW, "-o", str(out), "--precision", "int8", "--calib-data", str(calib),
                   "--calib-method", "minmax", "--streams", "2", "--profile", "input:0:1,4,8"])
    err = capsys.readouterr().err
    assert rc == 3, err
    assert INSTALL in err and "int8 ONNX model is ready" in err
    model = out / "open-nsfw.int8.onnx"
    assert convert.qdq_summary(str(model)).problems() == []
    record = json.loads((out / "open-nsfw.int8.build.json").read_text())
    assert record["tensorrt"]["status"] == "missing" and INSTALL in record["tensorrt"]["reason"]
    assert record["onnx_sha256"] == engine.sha256(NSFW) and record["precision"] == "int8"
    assert record["calibration"]["rows"] == 8 and len(record["calibration"]["row_sha256"]) == 8
    assert record["converted"]["check"]["problems"] == []
    assert record["converted"]["check"]["on_calibration_rows"]["argmax_agreement"] >= 0.875
    assert record["profile"] == {"input:0": [[1, 224, 224, 3], [4, 224, 224, 3], [8, 224, 224, 3]]}
    assert record["streams"] == 2 and "STRONGLY_TYPED" in record["flags"]

    rc = cli.main(["check-precision", NSFW, str(model), "--eval-data", str(evaluation), "--json", "--seconds", "0.2"])
    figures = json.loads(capsys.readouterr().out)
    assert rc == 0 and figures["rows"] == 12
    int8 = figures["models"][str(model)]
    assert int8["argmax_agreement"] >= 11 / 12 and int8["mean_abs_diff"] <= 0.03
    assert all(m["rows_per_s"] > 0 for m in figures["models"].values())

    rc = cli.main(["check-precision", NSFW, str(model), "--eval-data", str(calib)])
    assert rc == 2 and "8 of its rows calibrated" in capsys.readouterr().err  # the calibration set is refused


def test_fp16_build_and_table(tmp_path: Path, folders: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert cli.main(["build", NSFW, "-o", str(out), "--precision", "fp16"]) == 3
    model = out / "open-nsfw.fp16.onnx"
    assert convert.fp16_summary(str(model))[0] > 50
    capsys.readouterr()
    assert cli.main(["check-precision", NSFW, str(model), "--eval-data", str(folders[1]), "--seconds", "0.2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "12 evaluation rows, ONNX Runtime CPU" and "(reference)" in lines[2]
    agreement, max_abs = lines[3].split()[1:3]
    assert agreement == "100.00%" and float(max_abs) <= 0.01


def test_npy_calibration_of_a_generic_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tiny = tmp_path / "tiny.onnx"
    tiny.write_bytes(tiny_model_bytes())
    np.save(tmp_path / "calib.npy", np.random.default_rng(0).standard_normal((16, 256)).astype(np.float32))
    rc = cli.main(["build", str(tiny), "-o", str(tmp_path / "out"), "--precision", "int8",
                   "--calib-data", str(tmp_path / "calib.npy"), "--calib-method", "percentile"])
    assert rc == 3, capsys.readouterr().err
    assert convert.qdq_summary(str(tmp_path / "out" / "tiny.int8.onnx")).problems() == []


@pytest.mark.parametrize(("extra", "message"), [
    (["--precision", "int8"], "--precision int8 needs --calib-data"),
    (["--profile", "x:1,2,3"], "--profile 'x:1,2,3': expected NAME:MIN,OPT,MAX with NAME one of ['input:0']"),
    (["--profile", "input:0:8,4,1"], "needs 0 < min <= opt <= max"),
    (["--streams", "0"], "--streams must be at least 1"),
    (["--precision", "int8", "--calib-data", "nowhere.txt"], "expected an image folder, a .npy or a .npz file"),
])
def test_usage_errors_name_the_option(tmp_path: Path, extra: list[str], message: str,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["build", NSFW, "-o", str(tmp_path / "out"), *extra]) == 2
    assert message in capsys.readouterr().err


def test_npz_needs_the_input_names(tmp_path: Path) -> None:
    np.savez(tmp_path / "d.npz", a=np.zeros((2, 224, 224, 3), np.float32), b=np.zeros((2, 1), np.float32))
    with pytest.raises(calibration.DataError, match=r"one array per model input \['input:0'\]"):
        calibration.load(str(tmp_path / "d.npz"), NSFW, "opennsfw")
    np.save(tmp_path / "d.npy", np.zeros((2, 3, 224, 224), np.float32))
    with pytest.raises(calibration.DataError, match=r"shape \[2, 3, 224, 224\], the model expects"):
        calibration.load(str(tmp_path / "d.npy"), NSFW, "opennsfw")


def test_sidecar_matches_and_mismatches_name_the_field() -> None:
    """The sidecar build writes for a plan of the nsfw model, checked as an H200 worker with TensorRT 11.4 does."""
    ort_model = OnnxRuntimeEngine(NSFW, intra_op_threads=1)
    io = {k: [{"name": s.name, "dtype": s.dtype.name, "shape": list(s.shape)} for s in specs]
          for k, specs in (("inputs", ort_model.inputs), ("outputs", ort_model.outputs))}
    options = engine.BuildOptions(shapes={"input:0": ((1, 224, 224, 3), (8, 224, 224, 3), (8, 224, 224, 3))},
                                  streams=2)
    meta = engine.make_sidecar(onnx_path=NSFW, source_sha256="ab", precision="fp16", options=options, io=io,
                               tensorrt_version="11.4.0.106", gpu_name="NVIDIA H200", capability=(9, 0))
    assert len(meta["profiles"]) == 2 and meta["compute_capability"] == "9.0"
    here: dict[str, Any] = {"where": "nsfw.plan", "trt_version": "11.4.0.106", "gpu_name": "NVIDIA H200",
                            "capability": (9, 0)}
    check_plan_meta(json.loads(json.dumps(meta)), **here)  # as read back from the file: it loads
    check_plan_io(meta, ort_model.inputs, ort_model.outputs, "nsfw.plan")
    with pytest.raises(EngineError, match="sidecar field tensorrt_version"):
        check_plan_meta(meta, **{**here, "trt_version": "11.5.0.1"})
    with pytest.raises(EngineError, match="sidecar fields gpu_name, compute_capability"):
        check_plan_meta(meta, **{**here, "gpu_name": "NVIDIA A100", "capability": (8, 0)})
    stale = {**meta, "inputs": [{"name": "input:0", "dtype": "float32", "shape": [-1, 3, 224, 224]}]}
    with pytest.raises(EngineError, match=r"field 'inputs' declares \[\('input:0', 'float32', \(-1, 3, 224, 224\)\)\]"):
        check_plan_io(stale, ort_model.inputs, ort_model.outputs, "nsfw.plan")
