"""Each bad request gets its own status from the worker, and the worker goes on serving correct results.

These requests are crafted at the protocol level (tests/rawclient.py), as a C client or a hostile peer
would send them; the Python client would refuse most of them before sending.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest

from shmbroker.broker.common import protocol as P
from shmbroker.broker.common.protocol import SlotState
from shmbroker.client import Client, Overloaded
from tests.conftest import HINT_MODELS, RunningBroker, arr, start_broker
from tests.models import direct
from tests.rawclient import RawClient

S = P.Status
ANSWERED = (SlotState.DONE, SlotState.FAILED)


@pytest.fixture
def raw(broker: RunningBroker):
    rc = RawClient(broker.runtime_dir)
    yield rc
    rc.close()


def one(raw: RawClient, req: P.SubmitRequest) -> P.Result:
    raw.send(req)
    results = raw.recv()
    assert results is not None and len(results) == 1, "no answer from the worker"
    return results[0]


def assert_still_serves(raw: RawClient) -> None:
    x = np.random.default_rng(7).standard_normal((1, 256), dtype=np.float32)
    r = one(raw, raw.prepare(0, "tiny", x))
    assert r.status == S.OK, r.message
    np.testing.assert_allclose(raw.output(r, "tiny"), direct("tiny", x), rtol=0, atol=1e-5)


X = np.zeros((1, 256), np.float32)


def test_unknown_model(raw: RawClient) -> None:
    req = raw.prepare(0, "tiny", X)
    req.model_id = 99
    r = one(raw, req)
    assert r.status == S.UNKNOWN_MODEL and "model_id 99" in r.message
    assert_still_serves(raw)


def test_wrong_dtype(raw: RawClient) -> None:
    req = raw.prepare(0, "tiny", X)
    req.tensors[0].dtype = P.DType.FP64
    req.tensors[0].nbytes = 2048
    r = one(raw, req)
    assert r.status == S.BAD_DTYPE and "inputs['x'].dtype" in r.message and "float32" in r.message
    assert_still_serves(raw)


def test_wrong_shape(raw: RawClient) -> None:
    req = raw.prepare(0, "tiny", X)
    req.tensors[0].shape = (1, 128, 2)
    r = one(raw, req)
    assert r.status == S.BAD_SHAPE and "inputs['x'].shape" in r.message
    assert_still_serves(raw)


def test_too_many_rows_for_the_slot(raw: RawClient) -> None:
    req = raw.prepare(0, "tiny", X)
    req.tensors[0].shape = (raw.setup.max_items + 1, 256)
    req.tensors[0].nbytes = (raw.setup.max_items + 1) * 1024
    r = one(raw, req)
    assert r.status == S.BAD_SHAPE and "shape[0]" in r.message
    assert_still_serves(raw)


@pytest.mark.parametrize(("offset", "nbytes"), [(0, 1023), (0, 1025), (2**64 - 1, 1024), (2**63, 1024)])
def test_wrong_byte_size_or_span(raw: RawClient, offset: int, nbytes: int) -> None:
    req = raw.prepare(0, "tiny", X)
    req.tensors[0].offset = offset
    req.tensors[0].nbytes = nbytes
    r = one(raw, req)
    assert r.status == S.BAD_SIZE, r.message
    assert_still_serves(raw)


def test_span_past_the_slot_region(raw: RawClient) -> None:
    req = raw.prepare(0, "tiny", X)
    req.tensors[0].offset = raw.setup.in_capacity - 512  # in range, but 1024 bytes do not fit
    r = one(raw, req)
    assert r.status == S.BAD_SIZE and "exceed" in r.message
    assert_still_serves(raw)


@pytest.mark.parametrize("slot", [8, 9, 2**32 - 1])
def test_out_of_range_slot(raw: RawClient, slot: int) -> None:
    req = raw.prepare(0, "tiny", X)
    req.slot = slot
    r = one(raw, req)
    assert r.status == S.BAD_SLOT and "out of range" in r.message
    assert_still_serves(raw)


def test_stale_and_replayed_generation(raw: RawClient) -> None:
    req = raw.prepare(1, "tiny", X)
    assert one(raw, req).status == S.OK
    replay = one(raw, req)  # the same message again: the slot is DONE now, not SUBMITTED
    assert replay.status == S.STALE_GENERATION
    old = raw.prepare(1, "tiny", X)
    old.generation -= 1
    assert one(raw, old).status == S.STALE_GENERATION
    assert_still_serves(raw)


def test_wrong_token_and_garbage_are_dropped_without_harm(raw: RawClient) -> None:
    raw.send(raw.prepare(2, "tiny", X), token=raw.token ^ 1)
    raw.send_frames([b"\x01\x00\x20\x00", b"garbage"])
    raw.send_frames([b"x"])
    assert raw.recv(timeout=0.5) is None
    assert_still_serves(raw)


def dropped(b: RunningBroker, worker_id: int) -> dict[str, int]:
    """The worker's counts of SUBMITs dropped without an answer, as the broker's STATS reply carries them."""
    return next(w.dropped for w in b.stats().workers if w.worker_id == worker_id)


def test_dropped_submits_are_counted_by_reason_in_stats(broker: RunningBroker, raw: RawClient) -> None:
    """A SUBMIT the worker drops gets no answer, but STATS says why: a client's bug is not a silent hang."""
    before = dropped(broker, raw.link.worker_id)
    raw.send(raw.prepare(2, "tiny", X), token=raw.token ^ 1)
    raw.send(raw.prepare(3, "tiny", X), session_id=raw.session_id + 1000)
    raw.send_frames([b"\x01\x00\x20\x00", b"garbage"])
    raw.send_frames([b"x"])
    assert raw.recv(timeout=0.5) is None
    assert_still_serves(raw)  # answered after the drops: the worker took them in before, in order
    after = dropped(broker, raw.link.worker_id)
    moved = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    assert moved == {"wrong_token": 1, "unknown_session": 1, "malformed": 2}, (before, after)


def test_coalesced_submit_answers_every_request(raw: RawClient) -> None:
    xs = [np.full((1, 256), i, np.float32) for i in range(4)]
    reqs = [raw.prepare(i, "tiny", x) for i, x in enumerate(xs)]
    bad = raw.prepare(4, "tiny", X)
    bad.tensors[0].shape = (1, 3)
    raw.send(*reqs, bad)
    got: dict[int, P.Result] = {}
    while len(got) < 5:
        results = raw.recv()
        assert results is not None
        got.update({r.request_id: r for r in results})
    assert got[bad.request_id].status == S.BAD_SHAPE
    for req, x in zip(reqs, xs, strict=True):
        r = got[req.request_id]
        assert r.status == S.OK and r.slot == req.slot
        np.testing.assert_allclose(raw.output(r, "tiny"), direct("tiny", x), rtol=0, atol=1e-5)


def test_one_submit_alternating_between_models_answers_each_from_its_own_model(raw: RawClient) -> None:
    """The intake's fast path keeps the last record's model: a switch back and forth must not cross them."""
    rng = np.random.default_rng(11)
    plan = [("tiny", (1, 256)), ("nsfw", (1, 224, 224, 3)), ("tiny", (1, 256)), ("nsfw", (1, 224, 224, 3)),
            ("tiny", (1, 256))]
    xs = [rng.random(shape, dtype=np.float32) for _, shape in plan]
    reqs = [raw.prepare(i, model, x) for i, ((model, _), x) in enumerate(zip(plan, xs, strict=True))]
    raw.send(*reqs)
    got: dict[int, P.Result] = {}
    while len(got) < len(reqs):
        results = raw.recv()
        assert results is not None, f"only {len(got)} of {len(reqs)} answered"
        got.update({r.request_id: r for r in results})
    for req, (model, _), x in zip(reqs, plan, xs, strict=True):
        r = got[req.request_id]
        assert r.status == S.OK, r.message
        np.testing.assert_allclose(raw.output(r, model), direct(model, x), rtol=0, atol=1e-5)


def test_overload_is_answered_at_once(broker: RunningBroker) -> None:
    """nsfw has max_queue_size 3 in the test config: a burst of 8 overflows it."""
    x = np.zeros((1, 224, 224, 3), np.float32)
    with Client(slots=8) as c:
        futs = [c.submit("nsfw", x) for _ in range(8)]
        outcomes = []
        for f in futs:
            exc = f.exception(60)
            outcomes.append(type(exc).__name__ if exc else "ok")
        assert "Overloaded" in outcomes and "ok" in outcomes, outcomes
        assert set(outcomes) <= {"Overloaded", "ok"}
        err = next(e for f in futs if isinstance(e := f.exception(), Overloaded))
        assert err.code == "OVERLOADED" and "max_queue_size" in str(err)
        np.testing.assert_allclose(arr(c.infer("nsfw", x)), direct("nsfw", x), rtol=0, atol=1e-5)


@pytest.mark.parametrize(("model", "rounds"), [("tiny", 300), ("nsfw", 30)])  # run inline; on the runner thread
def test_a_slot_reused_as_soon_as_its_header_says_done_is_accepted(raw: RawClient, model: str, rounds: int) -> None:
    """A spinning client reuses a slot the moment its state word says DONE, before the DONE message; the
    worker has freed its claim by then, so the next request on that slot is served, not refused BAD_SLOT."""
    rng = np.random.default_rng(5)
    shape = raw.models[model].in_item_shapes[0]
    sent = []
    for _ in range(rounds):
        x = rng.standard_normal((1, *shape), dtype=np.float32)
        req = raw.prepare(0, model, x)
        raw.send(req)
        end = time.monotonic() + 20
        while raw.segment.read_slot(0)[0] not in ANSWERED:  # the header, not the DONE message
            if time.monotonic() > end:
                pytest.fail("no answer in the slot header within 20 s")
        state, gen, _rid, status = raw.segment.read_slot(0)
        assert (state, gen, status) == (SlotState.DONE, req.generation, S.OK)
        out = raw.models[model].info.outputs[0]
        np.testing.assert_allclose(raw.segment.output_view(0, 0, np.dtype("float32"), (1, *out.shape[1:])),
                                   direct(model, x), rtol=0, atol=1e-5)
        sent.append(req.request_id)
    answered: list[P.Result] = []
    while len(answered) < len(sent):
        results = raw.recv()
        assert results is not None, f"{len(answered)} of {len(sent)} DONE messages came"
        answered.extend(results)
    assert [r.request_id for r in answered] == sent
    assert {r.status for r in answered} == {S.OK}


def answered_in_header(raw: RawClient, slot: int, generation: int, within: float) -> bool:
    """Spin on the slot header as the client library does: yielding on every turn, so that on two cores the
    ZeroMQ IO threads that carry SUBMITs still run (a spin that does not yield starves them, and a SUBMIT
    then arrives after more hinted requests than the worker remembers: PROTOCOL 4.2)."""
    end = time.monotonic() + within
    while time.monotonic() < end:
        state, gen, _rid, _status = raw.segment.read_slot(slot)
        if state in ANSWERED and gen == generation:
            return True
        os.sched_yield()
    return False


def test_a_spinning_worker_takes_hinted_requests_and_drops_their_late_submits(tmp_path: Path) -> None:
    """Requests copied into the slot header are answered before their SUBMIT is sent; the SUBMITs, sent later
    together, are dropped: every request is answered exactly once, OK, with its own result."""
    models = HINT_MODELS
    b = start_broker(tmp_path, "process", models=models)
    raw = RawClient(b.runtime_dir)
    try:
        rng = np.random.default_rng(9)
        xs = [rng.standard_normal((1, 256), dtype=np.float32) for _ in range(8)]
        refs = [direct("tiny", x) for x in xs]  # beforehand: the worker spins only while requests come quickly
        held: list[P.SubmitRequest] = []  # answered from their hint: SUBMITs not sent yet
        order, early = [], 0
        for i in range(2000):
            req = raw.prepare(0, "tiny", xs[i % 8], hint=True)
            order.append(req.request_id)
            # Three of four requests are sent at once, which keeps the worker spinning between requests
            # (it spins only while they come quickly); the fourth waits 2 ms for the spinning worker first.
            if i % 4 == 3 and answered_in_header(raw, 0, req.generation, 0.002):
                early += 1
                held.append(req)
            else:  # the SUBMIT, with the held ones, brings it in
                raw.send(*held, req)
                held = []
                assert answered_in_header(raw, 0, req.generation, 20.0), "no answer within 20 s"
            state, _gen, _rid, status = raw.segment.read_slot(0)
            assert (state, status) == (SlotState.DONE, S.OK)
            got = raw.segment.output_view(0, 0, np.dtype("float32"), (1, 256))
            assert float(np.abs(got - refs[i % 8]).max()) <= 1e-5, f"request {i}: wrong result"
            if early >= 20:
                break
        if held:
            raw.send(*held)
        answered: list[P.Result] = []
        while len(answered) < len(order):
            results = raw.recv()
            assert results is not None, f"{len(answered)} of {len(order)} answers came"
            answered.extend(results)
        assert [r.request_id for r in answered] == order and {r.status for r in answered} == {S.OK}
        assert raw.recv(timeout=0.3) is None, "a dropped SUBMIT was answered"
        assert early > 0, "no request was taken from its hint"
    finally:
        raw.close()
        assert b.stop() == 0, b.log()


def test_submits_of_hinted_requests_are_dropped_however_late(tmp_path: Path) -> None:
    """The SUBMITs of 40 requests taken from their hints in one slot, sent only after all were answered (more
    than the worker's memory of twice the slot count): none is answered again, and the worker serves on."""
    b = start_broker(tmp_path, "process", models=HINT_MODELS)
    raw = RawClient(b.runtime_dir)
    try:
        x = np.ones((1, 256), np.float32)
        held: list[P.SubmitRequest] = []
        for i in range(4000):
            req = raw.prepare(0, "tiny", x, hint=True)
            early = i % 4 == 3 and answered_in_header(raw, 0, req.generation, 0.002)
            if early:
                held.append(req)  # answered from its hint: its SUBMIT waits
            else:
                raw.send(req)
            results = raw.recv()
            assert results is not None and [(r.request_id, r.status) for r in results] == [(req.request_id, S.OK)]
            if len(held) == 40:
                break
        assert len(held) == 40, f"only {len(held)} requests were taken from their hints"
        assert 2 * raw.segment.layout.n_slots < 40
        raw.send(*held)
        assert raw.recv(timeout=0.5) is None, "a late SUBMIT of a hinted request was answered"
        assert_still_serves(raw)
        # those the worker no longer remembered one by one were dropped as late, and STATS counts them
        assert dropped(b, raw.link.worker_id).get("late_hinted", 0) >= 40 - 2 * raw.segment.layout.n_slots
    finally:
        raw.close()
        assert b.stop() == 0, b.log()


def test_a_submit_naming_a_hinted_request_twice_gets_one_stale_answer(tmp_path: Path) -> None:
    """The first entry is the hinted request's own SUBMIT (dropped); the repeat is refused, and the worker serves on."""
    models = HINT_MODELS
    b = start_broker(tmp_path, "process", models=models)
    raw = RawClient(b.runtime_dir)
    try:
        x = np.ones((1, 256), np.float32)
        for i in range(2000):
            req = raw.prepare(0, "tiny", x, hint=True)
            early = i % 4 == 3 and answered_in_header(raw, 0, req.generation, 0.002)
            raw.send(req, req) if early else raw.send(req)
            got: list[P.Result] = []
            while len(got) < (2 if early else 1):
                results = raw.recv()
                assert results is not None, "an answer is missing"
                got.extend(results)
            if early:
                assert [(r.request_id, r.status) for r in got] == [(req.request_id, S.OK),
                                                                    (req.request_id, S.STALE_GENERATION)]
                break
            assert [r.status for r in got] == [S.OK]
        else:
            pytest.fail("no request was taken from its hint")
        assert_still_serves(raw)
    finally:
        raw.close()
        assert b.stop() == 0, b.log()
