"""The inductor engine on a GPU: ``shmbroker build --engine inductor`` compiles open-nsfw in fp16 into a package
of two buckets (1 and 8), the broker serves it to eight client processes at once, each checking its own results
against fp32 ONNX Runtime on the CPU (1e-2); a fresh process loads and runs it; ``check-precision`` runs the
package on real photographs; a package from another PyTorch is refused. Skipped where there is no CUDA device
(CI)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from shmbroker.gpu_worker import cuda
from tests.conftest import CLI, REPO, RunningBroker, run_client_processes
from tests.gpu.clients import CLIENTS, NSFW, REQUESTS, checked_client
from tests.gpu.conftest import gpu_broker

pytestmark = pytest.mark.skipif(not cuda.available(), reason="needs a CUDA device and cuda-python")

TOL = 1e-2  # fp16 against fp32 ONNX Runtime


@pytest.fixture(scope="module")
def package(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Built once per module with inductor's default kernel choices (max-autotune takes minutes a bucket)."""
    pytest.importorskip("torch")
    pytest.importorskip("onnx2torch")
    from shmbroker.gpu_worker.model_source import resolve

    tmp = tmp_path_factory.mktemp("inductor")
    cmd = [*CLI, "build", str(resolve(NSFW)), "-o", str(tmp / "out"), "--engine",
           "inductor", "--precision", "fp16", "--batch-sizes", "8,1", "--autotune", "default",
           "--cache-dir", str(tmp / "cache")]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    for stage in ("load ONNX", "compile batch 1", "compile batch 8", "package"):
        assert stage in r.stderr, f"no progress line for {stage!r}: {r.stderr[-2000:]}"
    return tmp / "out" / "open-nsfw.fp16.inductor.pt2"


@pytest.fixture(scope="module")
def inductor_broker(package: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningBroker]:
    tmp = tmp_path_factory.mktemp("inductor-broker")
    models = (f'[models.nsfwi]\npath = "{package}"\nengine = "inductor"\nmax_batch = 8\nstreams = 2\n'
              "max_queue_delay_us = 2000\nmax_queue_size = 1024\ntimeout_ms = 60000\n")
    with gpu_broker(tmp, models) as b:
        yield b


def test_the_sidecar_records_the_build(package: Path) -> None:
    import torch

    meta = json.loads(Path(f"{package}.json").read_text())
    assert meta["torch_version"] == torch.__version__
    assert meta["gpu_name"] == torch.cuda.get_device_name(0)
    assert meta["compute_capability"] == "{}.{}".format(*torch.cuda.get_device_capability(0))
    assert meta["precision"] == "fp16"
    assert meta["batch"] == {"mode": "buckets", "models": {"1": "batch_1", "8": "batch_8"}}
    assert meta["inputs"] == [{"name": "input:0", "dtype": "float32", "shape": [-1, 224, 224, 3]}]
    assert meta["outputs"] == [{"name": "outputs", "dtype": "float32", "shape": [-1, 2]}]
    assert set(meta["build_seconds"]) == {"load", "batch_1", "batch_8", "package"}


def test_eight_clients_get_their_own_results_from_the_package(inductor_broker: RunningBroker) -> None:
    runtime_dir = str(inductor_broker.runtime_dir)
    results = run_client_processes(checked_client, [(seed, runtime_dir, {"nsfwi": TOL}) for seed in range(CLIENTS)],
                                   240)
    assert sorted(r[0] for r in results) == list(range(CLIENTS))
    for seed, errors, wrong, distinct, _ in results:
        print(f"client {seed}: max abs fp16 inductor {errors['nsfwi']:.2e} against fp32 ONNX Runtime")
        assert not wrong, wrong
        assert distinct > 0.9, f"client {seed}: inputs too alike to detect a mix-up"
    m = next(m for w in inductor_broker.stats().workers for m in w.models if m.name == "nsfwi")
    assert m.requests.get("OK", 0) >= CLIENTS * REQUESTS, m.requests
    assert sum(int(k) * v for k, v in m.batch_items.items()) / m.batches > 1.0, m.batch_items


def test_check_precision_runs_the_package_on_real_photographs(package: Path, tmp_path: Path) -> None:
    from shmbroker.gpu_worker.model_source import resolve
    from tests import photoset

    _, eval_names = photoset.split()
    np.save(tmp_path / "eval.npy", photoset.nsfw_rows(eval_names, 48, seed=11))
    cmd = [*CLI, "check-precision", str(resolve(NSFW)), str(package),
           "--eval-data", str(tmp_path / "eval.npy"), "--seconds", "0.5", "--json"]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    entry = json.loads(r.stdout)["models"][str(package)]
    print(f"check-precision, 48 views of {len(eval_names)} photographs: max abs {entry['max_abs_diff']:.2e}, "
          f"argmax agreement {entry['argmax_agreement']:.1%}, {entry['rows_per_s']:.0f} rows/s")
    assert entry["rows"] == 48
    assert entry["max_abs_diff"] <= TOL


def test_a_fresh_process_loads_and_runs_the_package(package: Path) -> None:
    """As the worker does, with nothing loaded before it: a wrapper library that carries its own static C++
    runtime crashes such a process unless the engine shares the process's (share_cxx_runtime)."""
    code = ("import sys\nimport numpy as np\n"
            "from shmbroker.gpu_worker.engines.inductor import InductorEngine\n"
            f"engine = InductorEngine({str(package)!r}, device=0, max_batch=8)\n"
            "y = engine.run({'input:0': np.zeros((2, 224, 224, 3), np.float32)})\n"
            "print(y[0].shape, 'onnxruntime' in sys.modules)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                       check=False)
    assert r.returncode == 0, f"exit {r.returncode}: {r.stderr[-3000:]}"
    assert r.stdout.split() == ["(2,", "2)", "False"], r.stdout


@pytest.mark.parametrize(("field", "theirs"), [("torch_version", "2.10.0+cu128"), ("compute_capability", "8.0")])
def test_a_package_built_elsewhere_is_refused_naming_both_sides(package: Path, tmp_path: Path, field: str,
                                                                theirs: str) -> None:
    from shmbroker.gpu_worker.engines import EngineError, load_engine

    copy = tmp_path / package.name
    shutil.copyfile(package, copy)
    meta = json.loads(Path(f"{package}.json").read_text())
    ours = meta[field]
    meta[field] = theirs
    Path(f"{copy}.json").write_text(json.dumps(meta))
    with pytest.raises(EngineError) as err:
        load_engine("inductor", str(copy), device="0", max_batch=8)
    assert theirs in str(err.value) and ours in str(err.value) and field in str(err.value)


def test_a_slot_replays_one_graph_per_bucket_and_pads_rows(package: Path) -> None:
    import onnxruntime as ort

    from shmbroker.gpu_worker.engines import load_engine
    from shmbroker.gpu_worker.model_source import resolve

    engine = load_engine("inductor", str(package), device="0", max_batch=8)
    stream = cuda.Stream()
    try:
        ctx = engine.create_context(0, stream.handle, 8)  # type: ignore[attr-defined]
        assert ctx.graph_sizes == [1, 8]  # 2..8 rows run in the bucket of 8
        x = np.random.default_rng(4).random((3, 224, 224, 3), dtype=np.float32)
        want = ort.InferenceSession(str(resolve(NSFW)), providers=["CPUExecutionProvider"]).run(None, {"input:0": x})
        got = engine.run({"input:0": x})
        assert got[0].shape == (3, 2) and got[0].dtype == np.float32
        assert float(np.abs(got[0] - want[0]).max()) <= TOL
        ctx.close()
    finally:
        stream.synchronize()
        stream.close()
        engine.close()
