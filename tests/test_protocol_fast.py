"""The data plane's fast encoders write the same bytes as the full ones in broker.common.protocol, byte for byte: the
clients' SUBMIT body, the worker's DONE of OK answers (gpu_worker.codec), a slot header as a client posts it
with its hint (broker.common.ring) and the SUBMIT the worker makes of that hint (gpu_worker.hints), and the row count
that the worker's intake reads in place from a tensor descriptor."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shmbroker.broker.common import protocol as P
from shmbroker.broker.common.ring import RingLayout, Segment, segment_name
from shmbroker.gpu_worker.codec import ModelCodec
from shmbroker.gpu_worker.engines.base import IOSpec
from shmbroker.gpu_worker.hints import Watch, hinted_submit
from shmbroker.gpu_worker.intake import ModelView

u32 = st.integers(0, 2**32 - 1)
u64 = st.integers(0, 2**64 - 1)
dims = st.lists(st.integers(0, 2**40), min_size=0, max_size=P.MAX_DIMS).map(tuple)
tensor = st.builds(P.TensorDesc, st.integers(0, 2**16 - 1), st.sampled_from([int(d) for d in P.DType]), u64, u64,
                   dims)
request = st.builds(P.SubmitRequest, u64, u32, u32, u32, u32, st.lists(tensor, max_size=3))


def _records(reqs: list[P.SubmitRequest]) -> tuple[list[bytes], list[bytes], int]:
    """What a client packs per request (client.links.Links.flush): records, descriptors, tensor count."""
    records, descs, n_t = [], [], 0
    for r in reqs:
        records.append(P.REQUEST.pack(r.request_id, r.slot, r.generation, r.model_id, n_t, len(r.tensors),
                                      r.timeout_us))
        descs.append(b"".join(P.pack_tensor(t) for t in r.tensors))
        n_t += len(r.tensors)
    return records, descs, n_t


@given(u32, u64, st.lists(request, max_size=6))
def test_the_clients_submit_body_is_encode_submits(session_id: int, token: int, reqs: list[P.SubmitRequest]) -> None:
    records, descs, n_t = _records(reqs)
    fast = P.submit_body(session_id, token, records, descs, n_t)
    assert [P.envelope(P.MsgKind.SUBMIT), fast] == P.encode_submit(P.SubmitBatch(session_id, token, reqs))
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
    assert [P.envelope(P.MsgKind.DONE), fast] == P.encode_done(P.DoneBatch(session_id, results))


@settings(max_examples=50)
@given(u32, st.lists(st.tuples(u64, u32, u32, st.integers(1, 8)), min_size=1, max_size=8))
def test_the_codecs_done_of_ok_answers_is_encode_dones(session_id: int,
                                                        answers: list[tuple[int, int, int, int]]) -> None:
    outputs = [IOSpec("scores", np.dtype(np.float32), (-1, 2)), IOSpec("ids", np.dtype(np.int64), (-1, 3, 5))]
    view = ModelView(7, "m", 8, [IOSpec("x", np.dtype(np.float16), (-1, 4))], outputs, 500)
    codec = ModelCodec(view)
    done = [SimpleNamespace(req=SimpleNamespace(request_id=rid, slot=slot, generation=gen), rows=rows)
            for rid, slot, gen, rows in answers]
    full = P.encode_done(P.DoneBatch(session_id, [
        P.Result(rid, slot, gen, P.Status.OK, ModelCodec._canon(outputs, codec._out_codes, rows)[1])
        for rid, slot, gen, rows in answers]))
    assert codec.done_ok(session_id, done) == full  # type: ignore[arg-type]


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
