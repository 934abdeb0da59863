"""The PyTorch engine on a real GPU against ONNX Runtime on the CPU: fp32 within 1e-4, fp16 within 1e-2,
through create_context / enqueue with gpu_worker.cuda copies, CUDA graphs per batch size."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shmbroker.gpu_worker import cuda
from shmbroker.gpu_worker.engines import EngineError, is_device_engine, load_engine
from shmbroker.gpu_worker.engines.onnxruntime import OnnxRuntimeEngine
from shmbroker.gpu_worker.model_source import tiny_model_bytes
from tests.gpu.conftest import nsfw_path, requires_cuda

torch = pytest.importorskip("torch")
pytest.importorskip("onnx2torch")
pytestmark = [requires_cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA")]

MAX_BATCH = 12  # graphs for 1..8, 10 and 12 (graph_ladder): 9 and 11 rows run padded
INPUT = "input:0"


@pytest.fixture(scope="module")
def gpu_stream() -> Iterator[cuda.Stream]:
    cuda.set_device(0)
    s = cuda.Stream()
    yield s
    s.synchronize()
    s.close()


@pytest.fixture(scope="module")
def images() -> np.ndarray:
    # the range of the package's preprocessing (BGR minus the channel means)
    return np.random.default_rng(3).uniform(-125, 150, (MAX_BATCH, 224, 224, 3)).astype(np.float32)


@pytest.fixture(scope="module")
def reference(images: np.ndarray) -> np.ndarray:
    ort = OnnxRuntimeEngine(nsfw_path())
    return np.concatenate([ort.run({INPUT: images[i : i + 1]})[0] for i in range(MAX_BATCH)])


@pytest.fixture(scope="module", params=[False, True], ids=["fp32", "fp16"])
def engine(request: Any) -> Iterator[Any]:
    eng = load_engine("torch", nsfw_path(), device="0", fp16=request.param, cuda_graphs=True)
    yield eng
    eng.close()


def through_context(ctx: Any, stream: cuda.Stream, x: np.ndarray) -> np.ndarray:
    """What the pipeline does: H2D into the context's input buffer, enqueue, D2H, all on one stream."""
    rows = x.shape[0]
    out = np.empty((rows, 2), dtype=np.float32)
    cuda.memcpy_async(ctx.input_ptrs[0], x.ctypes.data, x.nbytes, "h2d", stream.handle)
    ctx.enqueue(rows)
    cuda.memcpy_async(out.ctypes.data, ctx.output_ptrs[0], out.nbytes, "d2h", stream.handle)
    stream.synchronize()
    return out


def test_nsfw_matches_onnxruntime(engine: Any, gpu_stream: cuda.Stream, images: np.ndarray, reference: np.ndarray):
    assert is_device_engine(engine)
    assert [(s.name, s.dtype, s.shape) for s in engine.inputs] == [(INPUT, np.dtype("float32"), (-1, 224, 224, 3))]
    ctx = engine.create_context(0, gpu_stream.handle, MAX_BATCH)
    if engine.graphs_failed is not None:
        pytest.fail(f"CUDA graph capture failed: {engine.graphs_failed}")
    assert ctx.graph_sizes == [*range(1, 9), 10, 12]
    tol = 1e-2 if engine.fp16 else 1e-4
    for rows in (1, MAX_BATCH, 3, 9, 11):
        got = through_context(ctx, gpu_stream, np.ascontiguousarray(images[:rows]))
        err = float(np.abs(got - reference[:rows]).max())
        print(f"\n{'fp16' if engine.fp16 else 'fp32'} graphs bs{rows}: max abs vs onnxruntime {err:.2e}")
        assert err <= tol
    host = engine.run({INPUT: images[:2]})[0]  # the eager host path of warm-up
    assert host.dtype == np.float32
    assert float(np.abs(host - reference[:2]).max()) <= tol
    ctx.close()


def test_contexts_on_two_streams_do_not_mix(engine: Any, images: np.ndarray, reference: np.ndarray):
    streams = [cuda.Stream(), cuda.Stream()]
    ctxs = [engine.create_context(i, s.handle, MAX_BATCH) for i, s in enumerate(streams)]
    outs = [np.empty((4, 2), dtype=np.float32) for _ in ctxs]
    feeds = [np.ascontiguousarray(images[:4]), np.ascontiguousarray(images[4:8])]
    for _ in range(5):  # interleaved, both in flight at once
        for ctx, s, x, out in zip(ctxs, streams, feeds, outs, strict=True):
            cuda.memcpy_async(ctx.input_ptrs[0], x.ctypes.data, x.nbytes, "h2d", s.handle)
            ctx.enqueue(4)
            cuda.memcpy_async(out.ctypes.data, ctx.output_ptrs[0], out.nbytes, "d2h", s.handle)
        for s in streams:
            s.synchronize()
        tol = 1e-2 if engine.fp16 else 1e-4
        assert float(np.abs(outs[0] - reference[:4]).max()) <= tol
        assert float(np.abs(outs[1] - reference[4:8]).max()) <= tol
    with pytest.raises(ValueError, match="rows"):
        ctxs[0].enqueue(MAX_BATCH + 1)
    for ctx in ctxs:
        ctx.close()
    for s in streams:
        s.close()


def test_graphs_off_runs_eagerly_with_the_same_answers(engine: Any, gpu_stream: cuda.Stream, images: np.ndarray,
                                                       reference: np.ndarray):
    """``cuda_graphs = false`` (a model's config key) captures no graph and changes no answer: every row count,
    padded ones included, comes back as the graphs give it and within the tolerance of ONNX Runtime. How much
    faster the graphs are is the bench's to measure (bench/gpu_inprocess.py reports the engine's graph_sizes and
    its rows per second under the config's cuda_graphs), not a test's: it depends on the machine."""
    eager: Any = load_engine("torch", nsfw_path(), device="0", fp16=engine.fp16, cuda_graphs=False)
    graphed_ctx = engine.create_context(0, gpu_stream.handle, MAX_BATCH)
    eager_ctx = eager.create_context(0, gpu_stream.handle, MAX_BATCH)
    try:
        assert eager_ctx.graph_sizes == []
        assert graphed_ctx.graph_sizes == [*range(1, 9), 10, 12]
        tol = 1e-2 if engine.fp16 else 1e-4
        for rows in (1, 9, MAX_BATCH):  # 9 rows run padded to the size of 10
            x = np.ascontiguousarray(images[:rows])
            got = through_context(eager_ctx, gpu_stream, x)
            assert got.shape == (rows, 2)
            assert float(np.abs(got - reference[:rows]).max()) <= tol
            assert float(np.abs(got - through_context(graphed_ctx, gpu_stream, x)).max()) <= tol
    finally:
        eager_ctx.close()
        graphed_ctx.close()
        eager.close()


def test_constant_reshapes_are_folded():
    import onnx
    from onnx2torch import convert

    from shmbroker.gpu_worker.engines.torch import fold_constant_reshapes

    module = convert(onnx.load(nsfw_path()))
    assert fold_constant_reshapes(module) == (2, 0)
    x = torch.randn(2, 224, 224, 3)
    assert tuple(module(x).shape) == (2, 2)


def test_builtin_tiny_from_bytes(gpu_stream: cuda.Stream):
    data = tiny_model_bytes()
    eng: Any = load_engine("torch", data, device="0", cuda_graphs=True)
    x = np.random.default_rng(5).standard_normal((5, 256)).astype(np.float32)
    want = OnnxRuntimeEngine(data).run({"x": x})[0]
    np.testing.assert_allclose(eng.run({"x": x})[0], want, atol=1e-4)
    ctx = eng.create_context(0, gpu_stream.handle, 8)
    out = np.empty_like(want)
    cuda.memcpy_async(ctx.input_ptrs[0], x.ctypes.data, x.nbytes, "h2d", gpu_stream.handle)
    ctx.enqueue(5)
    cuda.memcpy_async(out.ctypes.data, ctx.output_ptrs[0], out.nbytes, "d2h", gpu_stream.handle)
    gpu_stream.synchronize()
    np.testing.assert_allclose(out, want, atol=1e-4)
    eng.close()


def _small_net() -> Any:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).eval()


def test_torchscript_with_sidecar(tmp_path: Path):
    net = _small_net()
    path = tmp_path / "net.pt"
    torch.jit.trace(net, torch.randn(3, 16)).save(str(path))
    with pytest.raises(EngineError, match="declares no IO"):
        load_engine("torch", str(path), device="0")
    io = {"inputs": [{"name": "x", "dtype": "float32", "shape": [-1, 16]}],
          "outputs": [{"name": "y", "dtype": "float32", "shape": [-1, 4]}]}
    Path(str(path) + ".json").write_text(json.dumps(io))
    eng = load_engine("torch", str(path), device="0")
    x = np.random.default_rng(2).standard_normal((6, 16)).astype(np.float32)
    with torch.no_grad():
        want = net(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(eng.run({"x": x})[0], want, atol=1e-5)


def test_exported_program_io_from_the_program(tmp_path: Path):
    net = _small_net()
    batch = torch.export.Dim("batch", min=1, max=64)
    program = torch.export.export(net, (torch.randn(4, 16),), dynamic_shapes=({0: batch},))
    path = tmp_path / "net.pt2"
    torch.export.save(program, str(path))
    eng = load_engine("torch", str(path), device="0")
    assert [(s.dtype, s.shape) for s in eng.inputs] == [(np.dtype("float32"), (-1, 16))]
    assert [(s.dtype, s.shape) for s in eng.outputs] == [(np.dtype("float32"), (-1, 4))]
    x = np.random.default_rng(4).standard_normal((3, 16)).astype(np.float32)
    with torch.no_grad():
        want = net(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(eng.run({eng.inputs[0].name: x})[0], want, atol=1e-5)
