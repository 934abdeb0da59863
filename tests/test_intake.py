"""gpu_worker.intake: every descriptor of a request is checked against the sender's slot and the model before
anything is read, and a request that fails gets the status and a message naming the field, as the client
sees them in DONE; it says whether its slot was taken, so that the worker frees exactly the slots it took.

Intake is a unit with no process boundary: the session here is a stand-in with the ring's real layout, its
slot headers and input regions in a bytearray laid out as broker.common.ring lays out a segment.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, cast

import numpy as np
import pytest

from shmbroker.broker.common import protocol as P
from shmbroker.broker.common.protocol import SlotState, pack_offsets
from shmbroker.broker.common.ring import RingLayout
from shmbroker.gpu_worker.engines.base import IOSpec
from shmbroker.gpu_worker.intake import ModelView, Rejected, check_slot, check_tensors, input_arrays, out_layout
from shmbroker.gpu_worker.sessions import WorkerSession

S = P.Status
MAX_ITEMS = 4  # the session's rows a request; the model's max_batch (8) is larger
# a [N, 4] float32 (16 bytes a row) and b [N, 2] int64 (16 bytes a row) in; y [N, 8] float32 (32 bytes a row) out
MODEL = ModelView(3, "pair", 8, [IOSpec("a", np.dtype("float32"), (-1, 4)), IOSpec("b", np.dtype("int64"), (-1, 2))],
                  [IOSpec("y", np.dtype("float32"), (-1, 8))], 1000)
IN_CAP = pack_offsets([MAX_ITEMS * 16, MAX_ITEMS * 16])[1]  # what the broker sizes a slot's input region for
OUT_CAP = out_layout(MODEL.outputs, MAX_ITEMS)[1]
SLOT, GEN = 1, 5


class _Ring:
    """What intake reads of a session's segment (broker.common.ring.Segment's ``read_slot`` and ``input_view``)."""

    def __init__(self, layout: RingLayout) -> None:
        self.layout = layout
        self.buf = bytearray(layout.total_bytes)

    def publish(self, slot: int, state: int, generation: int) -> None:
        P.SLOT_HEADER.pack_into(self.buf, self.layout.slot_base(slot), state, generation, 0, 0)

    def read_slot(self, slot: int) -> tuple[int, int, int, int]:
        state, generation, rid, status = P.SLOT_HEADER.unpack_from(self.buf, self.layout.slot_base(slot))
        return state, generation, rid, status

    def input_view(self, slot: int, offset: int, dtype: np.dtype[Any], shape: tuple[int, ...]) -> np.ndarray:
        start = self.layout.input_base(slot) + offset
        return np.frombuffer(self.buf, dtype, math.prod(shape), start).reshape(shape)


@dataclass
class _Session:
    """A worker's session as intake uses it: the layout, the ring, the rows limit and the claims."""

    layout: RingLayout
    segment: _Ring
    max_items: int = MAX_ITEMS
    in_flight: set[int] = field(default_factory=set)

    def claim_slot(self, slot: int) -> bool:
        if slot in self.in_flight:
            return False
        self.in_flight.add(slot)
        return True


def _session(out_capacity: int = OUT_CAP) -> tuple[_Session, WorkerSession]:
    """A session of two slots, slot 1 SUBMITTED with generation 5 (the same object, as intake's type names it)."""
    layout = RingLayout(session_id=9, n_slots=2, in_capacity=IN_CAP, out_capacity=out_capacity)
    ring = _Ring(layout)
    ring.publish(SLOT, SlotState.SUBMITTED, GEN)
    s = _Session(layout, ring)
    return s, cast("WorkerSession", s)


def _request(rows: int = 2, slot: int = SLOT, generation: int = GEN) -> P.SubmitRequest:
    """A correct request for MODEL: a at offset 0, b at offset 64 of the slot's input region."""
    return P.SubmitRequest(77, slot, generation, MODEL.model_id, 0, [
        P.TensorDesc(0, P.DType.FP32, 0, rows * 16, (rows, 4)),
        P.TensorDesc(1, P.DType.INT64, 64, rows * 16, (rows, 2)),
    ])


def _with(t: int, **changes: Any) -> P.SubmitRequest:
    """The correct request with input descriptor ``t``'s fields changed."""
    req = _request()
    req.tensors[t] = replace(req.tensors[t], **changes)
    return req


def test_a_correct_request_claims_its_slot_and_has_its_rows() -> None:
    s, session = _session()
    check_slot(session, _request(rows=3))
    assert s.in_flight == {SLOT}
    assert check_tensors(session, _request(rows=3), MODEL) == 3
    assert check_tensors(session, _request(rows=MAX_ITEMS), MODEL) == MAX_ITEMS


@pytest.mark.parametrize(("req", "status", "message"), [
    (_request(slot=2), S.BAD_SLOT, "slot 2 is out of range (the ring has 2)"),
    (_request(slot=2**32 - 1), S.BAD_SLOT, "out of range"),
    (_request(generation=GEN - 1), S.STALE_GENERATION, f"generation {GEN - 1} is not the slot's submitted generation"),
], ids=["slot_past_the_ring", "slot_u32_max", "stale_generation"])
def test_a_request_that_does_not_name_its_submitted_slot_takes_no_slot(req: P.SubmitRequest, status: S,
                                                                        message: str) -> None:
    s, session = _session()
    with pytest.raises(Rejected) as e:
        check_slot(session, req)
    assert (e.value.status, e.value.claimed) == (status, False)
    assert message in e.value.message
    assert s.in_flight == set()


@pytest.mark.parametrize("state", [SlotState.FREE, SlotState.DONE, SlotState.FAILED])
def test_a_slot_whose_header_is_not_submitted_is_stale(state: int) -> None:
    s, session = _session()
    s.segment.publish(SLOT, state, GEN)
    with pytest.raises(Rejected) as e:
        check_slot(session, _request())
    assert (e.value.status, e.value.claimed) == (S.STALE_GENERATION, False)


def test_a_replayed_request_while_its_slot_is_in_flight_is_refused_and_the_first_keeps_the_slot() -> None:
    s, session = _session()
    check_slot(session, _request())
    with pytest.raises(Rejected) as e:
        check_slot(session, _request())
    assert (e.value.status, e.value.claimed) == (S.BAD_SLOT, False)  # not claimed: the slot is the first's
    assert f"slot {SLOT} already has a request in flight" in e.value.message
    assert s.in_flight == {SLOT}


U64 = 2**64 - 1
# (case, request, status, what the message says): every one is a mutation of the correct request
BAD_TENSORS: list[tuple[str, P.SubmitRequest, S, str]] = [
    ("input_missing", P.SubmitRequest(77, SLOT, GEN, 3, 0, _request().tensors[:1]), S.BAD_INPUT,
     "model 'pair' takes 2 inputs, got 1"),
    ("input_extra", P.SubmitRequest(77, SLOT, GEN, 3, 0, [*_request().tensors, _request().tensors[0]]),
     S.BAD_INPUT, "takes 2 inputs, got 3"),
    ("index_past_the_inputs", _with(1, index=2), S.BAD_INPUT, "input index 2 is out of range or repeated"),
    ("index_repeated", _with(1, index=0), S.BAD_INPUT, "input index 0 is out of range or repeated"),
    ("dtype_not_the_models", _with(0, dtype=P.DType.FP64), S.BAD_DTYPE,
     "inputs['a'].dtype: expected float32, got float64"),
    ("dtype_unknown", _with(1, dtype=99), S.BAD_DTYPE, "inputs['b'].dtype: expected int64, got code 99"),
    ("item_shape", _with(0, shape=(2, 5)), S.BAD_SHAPE, "inputs['a'].shape: expected [N, 4], got [2, 5]"),
    ("rank", _with(1, shape=(2, 2, 1)), S.BAD_SHAPE, "inputs['b'].shape: expected [N, 2], got [2, 2, 1]"),
    ("no_rows", _with(0, shape=(0, 4), nbytes=0), S.BAD_SHAPE, "inputs['a'].shape[0]: expected 1..4 rows, got 0"),
    ("rows_past_the_sessions", _with(0, shape=(5, 4), nbytes=80), S.BAD_SHAPE, "expected 1..4 rows, got 5"),
    ("rows_differ", _with(1, shape=(3, 2), nbytes=48), S.BAD_SHAPE,
     "inputs['b'].shape[0]: 3 rows, but another input has 2"),
    ("nbytes_short", _with(0, nbytes=31), S.BAD_SIZE, "inputs['a'].nbytes: shape [2, 4] needs 32, got 31"),
    ("nbytes_huge", _with(0, nbytes=U64), S.BAD_SIZE, f"needs 32, got {U64}"),
    ("offset_misaligned", _with(1, offset=68), S.BAD_SIZE, "inputs['b'].offset 68 is not a multiple of 8"),
    ("span_past_the_region", _with(1, offset=IN_CAP - 8), S.BAD_SIZE,
     f"exceed the slot region of {IN_CAP} bytes"),
    ("offset_past_the_region", _with(0, offset=U64 - 3), S.BAD_SIZE, f"exceed the slot region of {IN_CAP} bytes"),
]


@pytest.mark.parametrize(("req", "status", "message"), [c[1:] for c in BAD_TENSORS], ids=[c[0] for c in BAD_TENSORS])
def test_a_bad_descriptor_is_rejected_naming_its_field_and_the_slot_stays_to_be_freed(req: P.SubmitRequest,
                                                                                      status: S, message: str) -> None:
    s, session = _session()
    check_slot(session, req)
    with pytest.raises(Rejected) as e:
        check_tensors(session, req, MODEL)
    assert (e.value.status, e.value.claimed) == (status, True)  # the worker frees the slot with the answer
    assert message in e.value.message, e.value.message
    assert s.in_flight == {SLOT}


def test_rows_whose_outputs_do_not_fit_the_slot_are_bad_size() -> None:
    """A ring sized for fewer rows of output than the request has (the broker sizes both regions; a hostile
    or stale client can still ask for more rows than the output region holds)."""
    _, session = _session(out_capacity=out_layout(MODEL.outputs, 2)[1])
    assert check_tensors(session, _request(rows=2), MODEL) == 2
    with pytest.raises(Rejected) as e:
        check_tensors(session, _request(rows=3), MODEL)
    assert (e.value.status, e.value.claimed) == (S.BAD_SIZE, True)
    assert "outputs of 3 rows exceed the slot's output region" in e.value.message


def test_inputs_are_views_of_the_slot_in_the_models_order() -> None:
    """Descriptors may come in any order; the model gets its inputs in its own order, read in place (no copy):
    what the client wrote into the slot is what the model runs on."""
    s, session = _session()
    req = _request(rows=2)
    req.tensors.reverse()  # b's descriptor first
    a = np.arange(8, dtype=np.float32).reshape(2, 4)
    b = np.array([[1, -2], [2**40, 7]], dtype=np.int64)
    s.segment.input_view(SLOT, 0, a.dtype, a.shape)[...] = a
    s.segment.input_view(SLOT, 64, b.dtype, b.shape)[...] = b
    check_slot(session, req)
    assert check_tensors(session, req, MODEL) == 2
    got_a, got_b = input_arrays(session, req, MODEL)
    np.testing.assert_array_equal(got_a, a)
    np.testing.assert_array_equal(got_b, b)
    assert (got_a.dtype, got_b.dtype) == (np.dtype(np.float32), np.dtype(np.int64))
    s.segment.input_view(SLOT, 0, a.dtype, a.shape)[0, 0] = 42.0  # the slot changes: so does the view
    assert got_a[0, 0] == 42.0
