"""The TensorRT engine with the runtime installed from PyPI (tensorrt-lean-cu13): a corrupt plan, an empty plan
and plans whose sidecar names another TensorRT or another GPU each fail with a clear EngineError.

Running a real plan needs a plan, and building one needs the full TensorRT builder, which PyPI does not carry.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shmbroker.gpu_worker import cuda
from shmbroker.gpu_worker.engines import EngineError, load_engine
from shmbroker.gpu_worker.engines.tensorrt import import_tensorrt
from tests.gpu.conftest import requires_cuda

try:
    trt: Any = import_tensorrt()
except EngineError as exc:
    pytest.skip(f"no TensorRT runtime: {exc}", allow_module_level=True)

pytestmark = requires_cuda


def _load(path: Path) -> str:
    with pytest.raises(EngineError) as info:
        load_engine("tensorrt", str(path), device="0")
    print(f"\n{path.name}: {info.value}")
    return str(info.value)


def test_runtime_imports() -> None:
    print(f"\nTensorRT module {trt.__name__} {trt.__version__}")
    assert int(trt.__version__.split(".")[0]) >= 10
    assert hasattr(trt.Runtime(trt.Logger()), "engine_host_code_allowed")


def test_corrupt_plan_gives_the_loggers_reason(tmp_path: Path) -> None:
    plan = tmp_path / "garbage.plan"
    plan.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    text = _load(plan)
    assert "cannot deserialize" in text and trt.__version__ in text
    assert "magicTag" in text  # the logger's own words are in the message


def test_empty_plan_gives_the_loggers_reason(tmp_path: Path) -> None:
    plan = tmp_path / "empty.plan"
    plan.write_bytes(b"")
    text = _load(plan)
    assert "empty memory buffer" in text
    assert "differs from one already registered" not in text  # one logger for the process, as TensorRT wants


def test_matching_sidecar_lets_the_plan_through(tmp_path: Path) -> None:
    plan = tmp_path / "here.plan"
    plan.write_bytes(b"\1" * 64)
    cc = cuda.compute_capability(0)
    meta = {"tensorrt_version": trt.__version__, "gpu_name": cuda.device_name(0), "compute_capability": list(cc)}
    Path(f"{plan}.json").write_text(json.dumps(meta))
    assert "cannot deserialize" in _load(plan)  # past the sidecar check, stopped by TensorRT itself


def test_sidecar_from_another_tensorrt_names_both(tmp_path: Path) -> None:
    plan = tmp_path / "old.plan"
    plan.write_bytes(b"\0" * 64)
    Path(f"{plan}.json").write_text(json.dumps({"tensorrt_version": "10.3.0.26", "flags": []}))
    text = _load(plan)
    assert "10.3.0.26" in text and trt.__version__ in text


def test_sidecar_from_another_gpu_names_both(tmp_path: Path) -> None:
    plan = tmp_path / "other-gpu.plan"
    plan.write_bytes(b"\0" * 64)
    meta = {"tensorrt_version": trt.__version__, "gpu_name": "NVIDIA A10", "compute_capability": "8.6",
            "flags": ["VERSION_COMPATIBLE"]}
    Path(f"{plan}.json").write_text(json.dumps(meta))
    text = _load(plan)
    assert "NVIDIA A10" in text and cuda.device_name(0) in text and "8.6" in text
