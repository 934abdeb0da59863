"""The null engine on a GPU: its fixed device time per batch, its echo of each row, and a broker serving it to
several clients at once, each answer checked against its own request. Skipped without CUDA (CI)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from shmbroker.gpu_worker import cuda
from tests.conftest import RunningBroker
from tests.gpu.conftest import gpu_broker, nsfw_path

pytestmark = pytest.mark.skipif(not cuda.available(), reason="needs a CUDA device and cuda-python")


def test_each_batch_takes_the_set_device_time_and_echoes_its_rows(stream: cuda.Stream) -> None:
    pytest.importorskip("torch")
    from shmbroker.gpu_worker.engines import load_engine
    from shmbroker.gpu_worker.engines.null import expected_outputs

    engine = load_engine("null", nsfw_path(), device="0", null_compute_us=2000, max_batch=8)
    x = np.random.default_rng(1).standard_normal((3, 224, 224, 3), dtype=np.float32)
    (out,) = engine.run({"input:0": x})
    np.testing.assert_array_equal(out, expected_outputs(x, engine.outputs)[0])
    assert out.shape == (3, 2) and out[1, 0] == x[1, 0, 0, 0]
    ctx = engine.create_context(0, stream.handle, 8)  # type: ignore[attr-defined]
    start, end = cuda.Event(timing=True), cuda.Event(timing=True)
    times = []
    for rows in (1, 8, 1, 8):
        start.record(stream.handle)
        ctx.enqueue(rows)
        end.record(stream.handle)
        end.synchronize()
        times.append(cuda.elapsed_ms(start, end))
    ctx.close()
    print(f"null engine at 2000 us a batch: {[round(t, 3) for t in times]} ms")
    assert all(1.8 < t < 4.0 for t in times), times  # the spin counts device clocks: a bound, not a speed


@pytest.fixture(scope="module")
def null_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningBroker]:
    pytest.importorskip("torch")
    tmp = tmp_path_factory.mktemp("null-broker")
    models = (f'[models.null]\npath = "{nsfw_path()}"\nengine = "null"\nnull_compute_us = 200\nmax_batch = 64\n'
              "streams = 2\nmax_queue_size = 1024\ntimeout_ms = 60000\n")
    with gpu_broker(tmp, models) as b:
        yield b


def test_a_broker_on_the_null_engine_answers_every_request_with_its_own_row(null_broker: RunningBroker) -> None:
    from shmbroker.client import Client

    rng = np.random.default_rng(7)
    with Client(str(null_broker.runtime_dir), slots=32, max_items=1) as c:
        xs = [rng.standard_normal((1, 224, 224, 3), dtype=np.float32) for _ in range(200)]
        futures = [c.submit("null", x) for x in xs]
        for x, fut in zip(xs, futures, strict=True):
            out = fut.result(60)
            assert isinstance(out, np.ndarray)
            np.testing.assert_array_equal(out, x.reshape(1, -1)[:, :2])
    (m,) = [m for w in null_broker.stats().workers for m in w.models if m.name == "null"]
    assert m.requests.get("OK", 0) >= 200
    assert m.stages["compute"].count == m.batches
