"""What of the GPU engines can be checked without a GPU: device and package errors of load_engine, the
TensorRT sidecar checks, sidecar IO parsing and gpu_worker.cuda's behaviour without cuda-python."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from shmbroker.gpu_worker import cuda
from shmbroker.gpu_worker.engines import EngineError, graphed, load_engine, parse_device
from shmbroker.gpu_worker.engines import tensorrt as trt_engine
from shmbroker.gpu_worker.engines.meta import read_sidecar, spec_from_dims, specs_from_json
from shmbroker.gpu_worker.engines.tensorrt import check_plan_meta
from shmbroker.gpu_worker.model_source import tiny_model_bytes


def check(meta: dict[str, Any]) -> None:
    """The sidecar check as an H200 worker with TensorRT 11.4.0.106 runs it."""
    check_plan_meta(meta, where="a.plan", trt_version="11.4.0.106", gpu_name="NVIDIA H200", capability=(9, 0))


@pytest.mark.parametrize("kind", ["torch", "inductor", "tensorrt", "null"])
def test_gpu_engine_on_cpu_names_the_config_key(kind: str) -> None:
    with pytest.raises(EngineError, match=r"worker\.devices"):
        load_engine(kind, "model.onnx", device="cpu")


def test_devices_and_kinds() -> None:
    assert parse_device("cpu", "onnxruntime") is None
    assert parse_device("1", "torch") == 1
    with pytest.raises(EngineError, match="neither 'cpu' nor a GPU index"):
        parse_device("gpu0", "torch")
    with pytest.raises(EngineError, match="unknown engine 'tvm'"):
        load_engine("tvm", "m.onnx", device="0")


def test_onnxruntime_unchanged_on_a_gpu_worker() -> None:
    engine = load_engine("onnxruntime", tiny_model_bytes(), device="0", intra_op_threads=1)
    assert engine.run({"x": np.zeros((2, 256), dtype=np.float32)})[0].shape == (2, 256)


@pytest.mark.parametrize(("kind", "path"), [("torch", "model.onnx"), ("inductor", "model.pt2"), ("null", "model.onnx")])
def test_missing_torch_says_what_to_install(monkeypatch: pytest.MonkeyPatch, kind: str, path: str) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # an import of it now fails
    monkeypatch.setattr(graphed, "_torch_mod", None)
    with pytest.raises(EngineError, match="install torch"):
        load_engine(kind, path, device="0")


def test_missing_tensorrt_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in trt_engine._MODULES:
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(EngineError, match="tensorrt-lean-cu13"):
        load_engine("tensorrt", "model.plan", device="0")


def test_cuda_without_cuda_python(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)
    monkeypatch.setattr(cuda, "_rt", None)
    assert not cuda.available()
    assert not cuda.has_memcpy_batch()
    with pytest.raises(cuda.CudaUnavailable, match="cuda-python") as info:
        cuda.malloc(16)
    assert isinstance(info.value, cuda.CudaError) and info.value.call == "import cuda.bindings.runtime"


class _Runtime:
    """Just enough of cuda.bindings.runtime's calling convention to check the unpacking of results."""

    class cudaError_t:
        cudaSuccess = 0
        cudaErrorMemoryAllocation = 2
        cudaErrorNoDevice = 100

    names = {2: b"cudaErrorMemoryAllocation", 100: b"cudaErrorNoDevice"}

    def __init__(self, err: int) -> None:
        self.err = err

    def cudaGetErrorName(self, err: int) -> tuple[int, bytes]:
        return 0, self.names[err]

    def cudaMalloc(self, nbytes: int) -> tuple[int, Any]:
        return self.err, (None if self.err else 0xABC000)


def test_errors_carry_the_cuda_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cuda, "_rt", _Runtime(0))
    assert cuda.malloc(64) == 0xABC000
    monkeypatch.setattr(cuda, "_rt", _Runtime(2))
    with pytest.raises(cuda.CudaError) as info:
        cuda.malloc(64)
    assert (info.value.call, info.value.name) == ("cudaMalloc", "cudaErrorMemoryAllocation")
    assert str(info.value) == "cudaMalloc failed: cudaErrorMemoryAllocation"
    assert not isinstance(info.value, cuda.CudaUnavailable)
    monkeypatch.setattr(cuda, "_rt", _Runtime(100))
    with pytest.raises(cuda.CudaUnavailable):
        cuda.malloc(64)


def test_plan_from_another_tensorrt_names_both() -> None:
    with pytest.raises(EngineError, match=r"TensorRT 10\.3\.0.*TensorRT 11\.4\.0\.106"):
        check({"tensorrt_version": "10.3.0"})
    with pytest.raises(EngineError, match=r"version-compatible plan built with TensorRT 10\.14"):
        check({"tensorrt_version": "10.14.1", "flags": ["VERSION_COMPATIBLE"]})
    with pytest.raises(EngineError, match=r"11\.5\.0"):  # a newer plan than the runtime
        check({"tensorrt_version": "11.5.0", "flags": ["version_compatible"]})
    check({"tensorrt_version": "11.4.0.106"})
    check({"tensorrt_version": "11.1.0", "flags": ["VERSION_COMPATIBLE"]})


def test_plan_for_another_gpu_names_both(caplog: pytest.LogCaptureFixture) -> None:
    a100 = {"gpu_name": "NVIDIA A100-SXM4-80GB", "compute_capability": "8.0"}
    with pytest.raises(EngineError, match=r"NVIDIA A100-SXM4-80GB \(compute capability 8\.0\).*NVIDIA H200 \(9\.0\)"):
        check(a100)
    check({**a100, "flags": ["HARDWARE_COMPATIBILITY_AMPERE_PLUS"]})
    check({"gpu_name": "NVIDIA H100", "compute_capability": [9, 0]})
    assert "NVIDIA H100" in caplog.text  # same compute capability, another model: a warning only
    with pytest.raises(EngineError, match=r"not 'major\.minor'"):
        check({"compute_capability": "nine"})


def test_sidecar_io(tmp_path: Path) -> None:
    model = tmp_path / "m.pt"
    assert read_sidecar(str(model)) is None
    Path(f"{model}.json").write_text("{not json")
    with pytest.raises(EngineError, match="cannot read it"):
        read_sidecar(str(model))
    specs = specs_from_json([{"name": "x", "dtype": "float16", "shape": [-1, 3, 8]}], "input", "s")
    assert (specs[0].dtype, specs[0].shape, specs[0].item_bytes) == (np.dtype("float16"), (-1, 3, 8), 48)
    with pytest.raises(EngineError, match=r"inputs\[0\] needs name, dtype and shape"):
        specs_from_json([{"name": "x"}], "input", "s")
    with pytest.raises(EngineError, match="non-empty list"):
        specs_from_json(None, "output", "s")
    with pytest.raises(EngineError, match="fixed first dimension 8"):
        spec_from_dims("y", np.dtype("float32"), [8, 2], "output")
    with pytest.raises(EngineError, match="does not carry"):
        spec_from_dims("y", np.dtype("complex64"), [-1, 2], "output")
    assert spec_from_dims("y", np.dtype("int64"), [None, 2], "output").shape == (-1, 2)


def test_trt_logger_reason_is_kept() -> None:
    class FakeILogger:  # the base class the bindings provide; only its constructor is used
        def __init__(self) -> None:
            pass

    logger = trt_engine._make_logger(SimpleNamespace(ILogger=FakeILogger))
    logger.log(SimpleNamespace(name="INFO"), "loaded")
    logger.log(SimpleNamespace(name="ERROR"), "Serialization assertion header.magicTag failed\n")
    assert logger.take() == "Serialization assertion header.magicTag failed"
    assert logger.take() == "TensorRT logged no reason"
