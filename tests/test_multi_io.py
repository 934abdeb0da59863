"""A model with two inputs and two outputs: dict results, and descriptors in any order, batched across requests."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from shmbroker.broker.common import protocol as P
from shmbroker.broker.common.protocol import SlotState
from shmbroker.client import AsyncClient, Client
from tests.conftest import RunningBroker, start_broker
from tests.models import two_io_model
from tests.rawclient import RawClient


@pytest.fixture(scope="module")
def two_io(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningBroker, Path]]:
    tmp = tmp_path_factory.mktemp("two-io")
    model = two_io_model(tmp / "two_io.onnx")
    models = f'[models.two]\npath = "{model}"\nmax_batch = 8\nmax_queue_delay_us = 20000\npreferred_batch_sizes = [8]\n'
    b = start_broker(tmp, "process", models=models)
    try:
        yield b, model
    finally:
        assert b.stop_released() == 0


def expected(model: Path, a: np.ndarray, b: np.ndarray) -> list[np.ndarray]:
    out: list[np.ndarray] = ort.InferenceSession(str(model)).run(None, {"a": a, "b": b})
    return out


def test_dict_in_dict_out(two_io: tuple[RunningBroker, Path]) -> None:
    broker, model = two_io
    rng = np.random.default_rng(5)
    a = rng.standard_normal((3, 4), dtype=np.float32)
    b = rng.standard_normal((3, 2), dtype=np.float32)
    with Client(broker.runtime_dir, max_items=4) as c:
        out = c.infer("two", {"b": b, "a": a})
    assert isinstance(out, dict) and sorted(out) == ["r", "y"]
    y, r = expected(model, a, b)
    np.testing.assert_allclose(out["y"], y, rtol=0, atol=1e-5)
    np.testing.assert_allclose(out["r"], r, rtol=0, atol=1e-5)


def test_dict_in_dict_out_in_parts(two_io: tuple[RunningBroker, Path]) -> None:
    """8 rows through slots of 3: each input cut alike, each output put back in order (client.parts)."""
    broker, model = two_io
    rng = np.random.default_rng(7)
    a = rng.standard_normal((8, 4), dtype=np.float32)
    b = rng.standard_normal((8, 2), dtype=np.float32)
    y, r = expected(model, a, b)
    with Client(broker.runtime_dir, max_items=3) as c:
        for out in (c.infer("two", {"a": a, "b": b}), c.submit("two", {"b": b, "a": a}).result(60)):
            assert isinstance(out, dict) and sorted(out) == ["r", "y"]
            np.testing.assert_allclose(out["y"], y, rtol=0, atol=1e-5)
            np.testing.assert_allclose(out["r"], r, rtol=0, atol=1e-5)


def _async_parts(runtime_dir: Path, a: np.ndarray, b: np.ndarray) -> object:
    async def run() -> object:
        async with AsyncClient(runtime_dir, max_items=3) as ac:
            return await ac.infer("two", {"a": a, "b": b})

    return asyncio.run(run())


def test_dict_in_dict_out_in_parts_on_an_event_loop(two_io: tuple[RunningBroker, Path]) -> None:
    broker, model = two_io
    rng = np.random.default_rng(8)
    a = rng.standard_normal((7, 4), dtype=np.float32)
    b = rng.standard_normal((7, 2), dtype=np.float32)
    out = _async_parts(broker.runtime_dir, a, b)
    y, r = expected(model, a, b)
    assert isinstance(out, dict) and sorted(out) == ["r", "y"]
    np.testing.assert_allclose(out["y"], y, rtol=0, atol=1e-5)
    np.testing.assert_allclose(out["r"], r, rtol=0, atol=1e-5)


def test_descriptors_in_reverse_order_in_one_batch(two_io: tuple[RunningBroker, Path]) -> None:
    """Four requests in one SUBMIT, each naming input 1 before input 0 and placing b before a in its slot."""
    broker, model = two_io
    raw = RawClient(broker.runtime_dir, slots=4, max_items=2)
    try:
        plan = raw.models["two"]
        rng = np.random.default_rng(6)
        reqs, inputs = [], []
        for slot in range(4):
            a = rng.standard_normal((1, 4), dtype=np.float32)
            b = rng.standard_normal((1, 2), dtype=np.float32)
            raw.segment.input_view(slot, 0, b.dtype, b.shape)[...] = b  # b at 0, a after it: not canonical
            raw.segment.input_view(slot, 64, a.dtype, a.shape)[...] = a
            raw.gens[slot] += 1
            raw.segment.publish_slot(slot, SlotState.SUBMITTED, raw.gens[slot], 100 + slot, 0)
            tensors = [P.TensorDesc(1, P.DType.FP32, 0, b.nbytes, b.shape), P.TensorDesc(0, P.DType.FP32, 64, a.nbytes,
                                                                                        a.shape)]
            reqs.append(P.SubmitRequest(100 + slot, slot, raw.gens[slot], plan.info.model_id, 0, tensors))
            inputs.append((a, b))
        raw.send(*reqs)
        got: dict[int, P.Result] = {}
        while len(got) < 4:
            results = raw.recv()
            assert results is not None, "no answer"
            got.update({r.request_id: r for r in results})
        for req, (a, b) in zip(reqs, inputs, strict=True):
            r = got[req.request_id]
            assert r.status == P.Status.OK, r.message
            y_ref, r_ref = expected(model, a, b)
            outs = {t.index: raw.segment.output_view(r.slot, t.offset, plan.out_dtypes[t.index], t.shape) for t in
                    r.tensors}
            np.testing.assert_allclose(outs[0], y_ref, rtol=0, atol=1e-5)
            np.testing.assert_allclose(outs[1], r_ref, rtol=0, atol=1e-5)
        tiny_batches = next(m for w in broker.stats().workers for m in w.models if m.name == "two").batch_items
        assert any(int(k) > 1 for k in tiny_batches), f"the four requests did not share a batch: {tiny_batches}"
    finally:
        raw.close()

