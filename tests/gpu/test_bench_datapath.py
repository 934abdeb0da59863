"""bench.gpu_datapath, the (a'') figure, on a real GPU: the worker's stream slots move every row from a
registered ring to the device and its result back into its own ring slot, and the figures are measured."""

from __future__ import annotations

import secrets
from typing import Any

import numpy as np
import pytest

from shmbroker.bench import gpu_datapath
from shmbroker.broker.common.ring import RingLayout, Segment, segment_name
from shmbroker.gpu_worker import cuda
from shmbroker.gpu_worker.engines import load_engine
from shmbroker.gpu_worker.engines.onnxruntime import OnnxRuntimeEngine
from shmbroker.gpu_worker.model_source import TINY_WIDTH, tiny_model_bytes
from shmbroker.gpu_worker.streams import StreamSlot
from tests.gpu.conftest import requires_cuda

torch = pytest.importorskip("torch")
pytest.importorskip("onnx2torch")
pytestmark = [requires_cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA")]

ROWS = 8
ROW_BYTES = TINY_WIDTH * 4


def test_every_row_goes_through_the_device_into_its_own_ring_slot() -> None:
    cuda.set_device(0)
    data = tiny_model_bytes()
    engine: Any = load_engine("torch", data, device="0", cuda_graphs=True)
    seg = Segment.create(segment_name("t" + secrets.token_hex(4), 0), RingLayout(1, ROWS, ROW_BYTES, ROW_BYTES))
    xs = np.random.default_rng(7).standard_normal((ROWS, 1, TINY_WIDTH)).astype(np.float32)
    for r in range(ROWS):
        seg.input_view(r, 0, np.dtype("float32"), (1, TINY_WIDTH))[...] = xs[r]
    slots: list[StreamSlot] = []
    cuda.host_register(seg.address, seg.nbytes)
    try:
        slots = [StreamSlot(i, engine, ROWS) for i in range(2)]
        f = gpu_datapath.run_batches(engine, slots, seg, ROWS, 0.2)
        want = OnnxRuntimeEngine(data).run({"x": xs.reshape(ROWS, TINY_WIDTH)})[0]
        for r in range(ROWS):
            got = seg.output_view(r, 0, np.dtype("float32"), (1, TINY_WIDTH))
            np.testing.assert_allclose(got[0], want[r], atol=1e-4, err_msg=f"row {r}")
    finally:
        for s in slots:
            s.stream.synchronize()
            s.close()
        cuda.host_unregister(seg.address)
        seg.close()
        engine.close()
    assert f["batches"] >= gpu_datapath.MIN_BATCHES * 2 and f["items_per_s"] > 0
    assert f["compute_ms"] > 0 and f["h2d_ms"] > 0 and f["d2h_ms"] > 0
