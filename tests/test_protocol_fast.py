"""The data plane's fast encoders write the same bytes as the full ones in broker.common.protocol, byte for byte: the
clients' SUBMIT body, the worker's DONE of OK answers (gpu_worker.codec), a slot header as a client posts it
with its hint (broker.common.ring) and the SUBMIT the worker makes of that hint (gpu_worker.hints), and the row count
that the worker's intake reads in place from a tensor descriptor."""

from __future__ import annotations

import collections
import secrets
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shmbroker.broker.common import protocol as P
from shmbroker.broker.common.ring import RingLayout, Segment, segment_name
from shmbroker.client.session import ModelPlan
from shmbroker.gpu_worker.codec import ModelCodec
from shmbroker.gpu_worker.engines.base import IOSpec
from shmbroker.gpu_worker.hints import Watch, hinted_submit
from shmbroker.gpu_worker.intake import ModelView, out_layout

u32 = st.integers(0, 2**32 - 1)
u64 = st.integers(0, 2**64 - 1)
dims = st.lists(st.integers(0, 2**40), min_size=0, max_size=P.MAX_DIMS).map(tuple)
tensor = st.builds(P.TensorDesc, st.integers(0, 2**16 - 1), st.sampled_from([int(d) for d in P.DType]), u64, u64,
                   dims)
request = st.builds(P.SubmitRequest, u64, u32, u32, u32, u32, st.lists(tensor, max_size=3))


def _queued(reqs: list[P.SubmitRequest]) -> collections.deque[P.SubmitRecord]:
    """The requests as a client queues them on a link (client.client's _send)."""
    return collections.deque((r.request_id, r.slot, r.generation, r.model_id, len(r.tensors), r.timeout_us,
                              b"".join(P.pack_tensor(t) for t in r.tensors)) for r in reqs)


@given(u32, u64, st.lists(request, max_size=6))
def test_the_clients_submit_body_is_encode_submits(session_id: int, token: int, reqs: list[P.SubmitRequest]) -> None:
    """P.drain_submit is the packer that client.links.Links.flush sends with."""
    queue = _queued(reqs)
    fast = P.drain_submit(session_id, token, queue)
    assert not queue
    if not reqs:
        assert fast is None
        return
    assert fast is not None
    assert [P.SUBMIT_ENVELOPE, fast] == P.encode_submit(P.SubmitBatch(session_id, token, reqs))
    assert P.decode_submit(fast) == P.SubmitBatch(session_id, token, reqs)


@given(tensor.filter(lambda t: len(t.shape) > 0 and t.shape[0] < 2**63))
def test_the_row_count_read_in_place_is_the_first_dimension(t: P.TensorDesc) -> None:
    assert P.TENSOR_ROWS.unpack_from(P.pack_tensor(t), P.TENSOR_ROWS_AT)[0] == t.shape[0]


@given(u32, st.lists(st.tuples(u64, u32, u32, st.lists(tensor, max_size=3)), max_size=6))
def test_the_workers_ok_done_body_is_encode_dones(session_id: int,
                                                   answers: list[tuple[int, int, int, list[P.TensorDesc]]]) -> None:
    records, descs, n_t = [], [], 0
    for rid, slot, gen, tensors in answers:
        records.append(P.RESULT.pack(rid, slot, gen, P.Status.OK, n_t, len(tensors), 0, 0, 0))
        descs.append(b"".join(P.pack_tensor(t) for t in tensors))
        n_t += len(tensors)
    fast = P.done_body(session_id, records, descs, n_t)
    results = [P.Result(rid, slot, gen, P.Status.OK, tensors) for rid, slot, gen, tensors in answers]
    assert [P.DONE_ENVELOPE, fast] == P.encode_done(P.DoneBatch(session_id, results))


@settings(max_examples=50)
@given(u32, st.lists(st.tuples(u64, u32, u32, st.integers(1, 8)), min_size=1, max_size=8))
def test_the_codecs_done_of_ok_answers_is_encode_dones(session_id: int,
                                                        answers: list[tuple[int, int, int, int]]) -> None:
    outputs = [IOSpec("scores", np.dtype(np.float32), (-1, 2)), IOSpec("ids", np.dtype(np.int64), (-1, 3, 5))]
    view = ModelView(7, "m", 8, [IOSpec("x", np.dtype(np.float16), (-1, 4))], outputs, 500)
    codec = ModelCodec(view)
    done = [SimpleNamespace(req=SimpleNamespace(request_id=rid, slot=slot, generation=gen), rows=rows)
            for rid, slot, gen, rows in answers]
    out_specs = [(s.dtype, s.item_shape) for s in outputs]
    full = P.encode_done(P.DoneBatch(session_id, [
        P.Result(rid, slot, gen, P.Status.OK, P.CanonicalRows.of([], out_specs, rows).out_descs)
        for rid, slot, gen, rows in answers]))
    assert codec.done_ok(session_id, done) == full  # type: ignore[arg-type]


item_dtypes = st.sampled_from([P.numpy_dtype(d) for d in P.DType])
item_shapes = st.lists(st.integers(1, 5), max_size=3).map(tuple)
specs = st.lists(st.tuples(st.text("abcxyz", min_size=1, max_size=4), item_dtypes, item_shapes), min_size=1,
                 max_size=3, unique_by=lambda t: t[0])


@settings(max_examples=60)
@given(specs, specs, st.integers(1, 6))
def test_the_client_and_the_worker_use_one_canonical_layout(
        inputs: list[tuple[str, np.dtype[Any], tuple[int, ...]]],
        outputs: list[tuple[str, np.dtype[Any], tuple[int, ...]]], max_batch: int) -> None:
    """What the client sends and expects back (client.session.ModelPlan) is what the worker compares and
    answers with (gpu_worker.codec.ModelCodec): one protocol.CanonicalRows per row count, which the worker's
    detailed checks (gpu_worker.intake) would accept as well."""
    info = P.ModelInfo(3, "m", max_batch, [P.TensorSpec(n, dt.name, [-1, *shape]) for n, dt, shape in inputs],
                       [P.TensorSpec(n, dt.name, [-1, *shape]) for n, dt, shape in outputs], 500)
    view = ModelView(3, "m", max_batch, [IOSpec(n, dt, (-1, *shape)) for n, dt, shape in inputs],
                     [IOSpec(n, dt, (-1, *shape)) for n, dt, shape in outputs], 500)
    plan, codec = ModelPlan.of(info), ModelCodec(view)
    for rows in range(1, max_batch + 1):
        lay = plan.layout(rows)
        assert lay == codec.rows[rows]
        assert lay.in_desc_bytes == b"".join(map(P.pack_tensor, lay.in_descs))
        assert lay.out_offsets == out_layout(view.outputs, rows)[0]
        sent = P.SubmitRequest(1, 0, 1, 3, 0, lay.in_descs)
        assert P.decode_submit(P.encode_submit(P.SubmitBatch(1, 2, [sent]))[1]).requests == [sent]
        assert [(d.dtype, d.shape) for d in lay.in_descs] == [
            (P.dtype_code(dt), (rows, *shape)) for _n, dt, shape in inputs]


@pytest.fixture(scope="module")
def segment() -> Iterator[Segment]:
    seg = Segment.create(segment_name("t" + secrets.token_hex(4), 0), RingLayout(9, 4, 4096, 4096))
    yield seg
    seg.close()


@settings(max_examples=60)
@given(slot=st.integers(0, 3), worker=st.integers(0, 2**16 - 1), rid=u64, gen=u32, model=u32,
       timeout=u32, tensors=st.lists(tensor, max_size=10), token=u64)
def test_a_posted_slot_header_and_the_workers_hint_submit(segment: Segment, slot: int, worker: int, rid: int,
                                                         gen: int, model: int, timeout: int,
                                                         tensors: list[P.TensorDesc], token: int) -> None:
    descs = b"".join(P.pack_tensor(t) for t in tensors)
    hinted = segment.post_request(slot, worker, rid, gen, model, len(tensors), timeout, descs)
    base = segment.layout.slot_bases[slot]
    buf = segment.buf
    assert P.SLOT_HEADER.unpack_from(buf, base) == (P.SlotState.SUBMITTED, gen, rid, 0)
    record = P.REQUEST.pack(rid, slot, gen, model, 0, len(tensors), timeout) + descs
    assert hinted == (len(record) <= P.HINT_CAPACITY)
    if not hinted:
        assert P.HINT.unpack_from(buf, base + P.HINT_AT) == (0, 0)
        return
    assert P.HINT.unpack_from(buf, base + P.HINT_AT) == (len(record), worker)
    assert bytes(buf[base + P.HINT_RECORD_AT : base + P.HINT_RECORD_AT + len(record)]) == record
    session = SimpleNamespace(segment=segment, layout=segment.layout, session_id=9, token=token)
    submit = hinted_submit(Watch(session, slot, gen), worker)  # type: ignore[arg-type]
    req = P.SubmitRequest(rid, slot, gen, model, timeout, tensors)
    assert [P.envelope(P.MsgKind.SUBMIT), submit] == P.encode_submit(P.SubmitBatch(9, token, [req]))
    segment.set_state(slot, P.SlotState.FREE, 0)
