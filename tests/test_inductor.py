"""What of the inductor engine can be checked without a GPU: ``shmbroker build --engine inductor``'s option
checks and its exit 3 without PyTorch, CUDA or Triton, and the package sidecar check that the worker runs before
loading. The build, the engine and the broker on a package run on the GPU (tests/gpu/test_inductor.py)."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from shmbroker.broker.common import config
from shmbroker.broker.modelbuild import inductor
from shmbroker.broker.modelbuild.engine import BuilderMissing
from shmbroker.gpu_worker.engines import EngineError
from shmbroker.gpu_worker.engines.inductor import FORMAT, _batch_plan, check_package_meta, package_meta
from shmbroker.gpu_worker.model_source import tiny_model_bytes
from tests.conftest import REPO

H200 = {"torch_version": "2.11.0+cu130", "cuda_version": "13.0", "triton_version": "3.6.0",
        "gpu_name": "NVIDIA H200", "compute_capability": "9.0"}
IO = {"inputs": [{"name": "x", "dtype": "float32", "shape": [-1, 256]}],
      "outputs": [{"name": "y", "dtype": "float32", "shape": [-1, 256]}]}


def meta(**changes: Any) -> dict[str, Any]:
    """The sidecar that a build on the H200 writes for buckets 1, 8 and 32, with ``changes``."""
    m = package_meta(facts=H200, precision="fp16", sizes=[32, 1, 8], dynamic=False, io=IO, onnx_name="m.onnx",
                     onnx_sha256="0" * 64, options={"max_autotune": True}, seconds={"batch_1": 1.0})
    m.update(changes)
    return m


def check(m: dict[str, Any]) -> None:
    check_package_meta(m, where="m.pt2", facts=H200)


def test_the_engine_shares_the_processs_cxx_runtime_before_a_package_loads() -> None:
    """A wrapper library with its own static C++ runtime binds the locale to the process's libstdc++ only when
    that one is in the global symbol scope: after share_cxx_runtime() a bare dlsym finds it."""
    code = ("import ctypes\n"
            "from shmbroker.gpu_worker.engines.inductor import share_cxx_runtime\n"
            "def found():\n"
            "    return hasattr(ctypes.CDLL(None), '_ZNSt6locale7classicEv')\n"
            "before = found(); share_cxx_runtime(); share_cxx_runtime()\n"
            "print(before, found())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["False", "True"], out.stdout + out.stderr


def test_the_sidecar_of_buckets_and_of_a_dynamic_batch() -> None:
    m = meta()
    assert m["format"] == FORMAT and m["precision"] == "fp16" and m["torch_version"] == "2.11.0+cu130"
    assert m["batch"] == {"mode": "buckets", "models": {"1": "batch_1", "8": "batch_8", "32": "batch_32"}}
    assert _batch_plan(m, "m.pt2") == ("buckets", {1: "batch_1", 8: "batch_8", 32: "batch_32"})
    dyn = package_meta(facts=H200, precision="fp32", sizes=[256], dynamic=True, io=IO, onnx_name="m.onnx",
                       onnx_sha256="0" * 64, options={}, seconds={})
    assert _batch_plan(dyn, "m.pt2") == ("dynamic", {256: "dynamic"})


def test_a_package_of_this_machine_is_accepted() -> None:
    check(meta())
    check(meta(torch_version="2.11.0"))  # the same release without the local build tag


@pytest.mark.parametrize(("field", "theirs", "words"), [
    ("torch_version", "2.10.0+cu128", ["PyTorch 2.10.0+cu128", "PyTorch 2.11.0+cu130"]),
    ("cuda_version", "12.8", ["CUDA 12.8", "CUDA 13.0"]),
    ("compute_capability", "8.0", ["compute capability 8.0", "compute capability 9.0", "NVIDIA H200"]),
])
def test_a_package_built_elsewhere_names_the_field_and_both_sides(field: str, theirs: str, words: list[str]) -> None:
    with pytest.raises(EngineError) as err:
        check(meta(**{field: theirs}))
    text = str(err.value)
    assert f"sidecar field {field}" in text and "shmbroker build --engine inductor" in text
    for word in words:
        assert word in text


def test_another_gpu_of_the_same_generation_or_another_triton_is_only_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        check(meta(gpu_name="NVIDIA H100 80GB HBM3", triton_version="3.5.0"))
    assert "NVIDIA H100 80GB HBM3" in caplog.text and "3.5.0" in caplog.text


@pytest.mark.parametrize("change", [{"format": "other/1"}, {"batch": {"mode": "buckets"}},
                                    {"batch": {"mode": "ragged", "models": {"8": "b"}}},
                                    {"batch": {"mode": "dynamic", "models": {"8": "a", "16": "b"}}}])
def test_a_malformed_sidecar_is_refused(change: dict[str, Any]) -> None:
    m = meta(**change)
    with pytest.raises(EngineError, match="shmbroker build --engine inductor"):
        check(m)
        _batch_plan(m, "m.pt2")


def test_the_config_takes_engine_inductor_and_refuses_fp16_with_it() -> None:
    cfg = config.parse({"worker": {"devices": [0]}, "models": {"m": {"path": "m.pt2", "engine": "inductor"}}})
    assert cfg.models["m"].engine == "inductor"
    with pytest.raises(config.ConfigError, match=r"key 'models\.m\.fp16'.*shmbroker build --precision fp16"):
        config.parse({"models": {"m": {"path": "m.pt2", "engine": "inductor", "fp16": True}}})


def _build(tmp: Path, *extra: str, block: str = "") -> subprocess.CompletedProcess[str]:
    model = tmp / "tiny.onnx"
    model.write_bytes(tiny_model_bytes())
    argv = ["build", str(model), "-o", str(tmp / "out"), "--engine", "inductor", *extra]
    code = (f"import sys; {block}from broker.cli import main; sys.exit(main({argv!r}))")
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                          check=False)


def test_build_without_pytorch_exits_3_and_says_what_to_install(tmp_path: Path) -> None:
    r = _build(tmp_path, block="sys.modules['torch'] = None; ")  # as where PyTorch is not installed
    assert r.returncode == 3, r.stderr
    assert "--engine inductor needs PyTorch with CUDA" in r.stderr and "install torch" in r.stderr
    assert "Traceback" not in r.stderr
    record = json.loads((tmp_path / "out" / "tiny.fp16.inductor.build.json").read_text())
    assert record["inductor"]["status"] == "missing"


@pytest.mark.parametrize(("args", "words"), [
    (["--precision", "int8"], "--precision int8 is for --engine tensorrt"),
    (["--batch-sizes", "8,0"], "--batch-sizes '8,0'"),
    (["--batch-sizes", "eight"], "--batch-sizes 'eight'"),
])
def test_build_refuses_bad_options_with_exit_2(tmp_path: Path, args: list[str], words: str) -> None:
    r = _build(tmp_path, *args)
    assert r.returncode == 2, r.stderr
    assert words in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize(("fake", "words"), [
    (SimpleNamespace(__version__="2.11.0+cpu", cuda=SimpleNamespace(is_available=lambda: False)),
     "PyTorch 2.11.0+cpu sees none"),
    (SimpleNamespace(__version__="2.11.0+cu130", cuda=SimpleNamespace(is_available=lambda: True)),
     "--engine inductor needs Triton"),
])
def test_without_cuda_or_triton_the_compiler_says_what_is_missing(monkeypatch: pytest.MonkeyPatch, fake: Any,
                                                                  words: str, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "torch", fake)
    monkeypatch.setitem(sys.modules, "triton", None)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "")
    with pytest.raises(BuilderMissing, match=re.escape(words)):
        inductor.import_compiler(str(tmp_path / "cache"))
