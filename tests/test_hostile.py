"""Hostile input (bench/RESULTS.md#reliability, item 5): a live worker process gets random and mutated SUBMITs
and slot headers.

Each message is crafted from a correct one (tests/rawclient.py) and then mutated by hypothesis: fields of
the records and descriptors (huge, negative as u64, overflowing offsets, shapes that disagree with the
byte count, other slots and models, replayed and stale generations), bytes of the encoded frames
(truncated, flipped, spliced, wrong kinds, extra frames) and the slot headers themselves. The oracle:

- a message that decodes (the worker's own decoder) and names the sender's session and token gets one
  result per request, each with a status; any other message is dropped, and the worker logs that at most
  once per 5 s (``RateLimitedLog``);
- the victim session's whole ring and every byte of the sender's ring outside the output regions and
  slot headers of the slots the message names are unchanged afterwards;
- the worker process is the same one at the end and still serves correct results.

Default CI sends a few hundred messages; ``pytest -m long tests/test_hostile.py`` sends 10,000+.
"""

from __future__ import annotations

import collections
import re
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shmbroker.broker.common import protocol as P
from shmbroker.broker.common.protocol import SLOT_HEADER_BYTES
from shmbroker.broker.common.ring import HEADER_BYTES
from shmbroker.client import Client
from tests.conftest import arr, start_broker
from tests.models import direct
from tests.rawclient import RawClient

MODELS = """
[models.tiny]
path = "builtin:tiny"
max_batch = 16
max_queue_delay_us = 500
timeout_ms = 2000
intra_op_threads = 1

[models.small]
path = "builtin:tiny"
max_batch = 2
max_queue_delay_us = 500
timeout_ms = 2000
intra_op_threads = 1
"""
SLOTS = 8
U64 = 2**64 - 1
X = np.random.default_rng(3).standard_normal((1, 256), dtype=np.float32)


class Arena:
    """A live broker (process mode), a sender session and a victim session filled with canary bytes."""

    def __init__(self, tmp: Path) -> None:
        self.broker = start_broker(tmp, "process", models=MODELS)
        self.sender = RawClient(self.broker.runtime_dir, slots=SLOTS, max_items=4)
        self.victim = RawClient(self.broker.runtime_dir, slots=SLOTS, max_items=4)
        vbuf = self.victim.segment.buf
        vbuf[HEADER_BYTES:] = bytes([0xA5]) * (len(vbuf) - HEADER_BYTES)
        self.victim_bytes = bytes(vbuf)
        self.worker_pid = self.broker.worker_pids()[0]
        self.messages = 0
        self.dropped = 0
        self.started = time.monotonic()

    def close(self) -> None:
        self.sender.close()
        self.victim.close()
        assert self.broker.stop_released() == 0, self.broker.log()


@pytest.fixture(scope="module")
def arena(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Arena]:
    a = Arena(tmp_path_factory.mktemp("hostile"))
    try:
        yield a
    finally:
        a.close()


# -- mutations -------------------------------------------------------------------------------------------
def big_ints() -> st.SearchStrategy[int]:
    """Values a fuzzer should try for u32/u64 fields: edges, overflow bait, and anything."""
    return st.one_of(st.sampled_from([0, 1, 7, 255, 256, 1023, 1024, 1025, 2**31, 2**32 - 1, 2**63, U64]),
                     st.integers(0, U64))


FIELD_MUTATIONS = ["slot", "generation", "model_id", "timeout_us", "index", "dtype", "offset", "nbytes", "shape",
                   "rows", "no_tensors", "extra_tensor", "victim_slot"]


@st.composite
def field_mutation(draw: st.DrawFn) -> tuple[str, int]:
    return draw(st.sampled_from(FIELD_MUTATIONS)), draw(big_ints())


def mutate_request(req: P.SubmitRequest, what: str, v: int) -> None:
    t = req.tensors[0] if req.tensors else P.TensorDesc(0, 0, 0, 0, (1,))
    if what == "slot":
        req.slot = v & 0xFFFF_FFFF
    elif what == "generation":
        req.generation = v & 0xFFFF_FFFF
    elif what == "model_id":
        req.model_id = v & 0xFFFF_FFFF
    elif what == "timeout_us":
        req.timeout_us = v & 0xFFFF_FFFF
    elif what == "index":
        t.index = v & 0xFFFF
    elif what == "dtype":
        t.dtype = v & 0xFF
    elif what == "offset":
        t.offset = v
    elif what == "nbytes":
        t.nbytes = v
    elif what == "shape":  # a shape that does not match the byte count (or a negative one, as i64)
        t.shape = (1, v % 4096 - 2048) if v % 3 else (v % 5, 256, v % 7)
    elif what == "rows":
        rows = v % 40 - 4
        t.shape = (rows, 256)
    elif what == "no_tensors":
        req.tensors = []
    elif what == "extra_tensor":
        req.tensors.append(P.TensorDesc(v % 3, t.dtype, t.offset, t.nbytes, t.shape))
    elif what == "victim_slot":  # what lies beyond our ring: another session's slot numbers, far ranges
        req.slot = SLOTS + v % 64


REC_FIELDS = {"first_tensor": 20, "n_tensors": 24}


@st.composite
def byte_mutation(draw: st.DrawFn) -> tuple[str, int, int]:
    kind = draw(st.sampled_from(["truncate", "flip", "extend", "header_count", "record_field", "kind", "frames",
                                 "session", "token"]))
    return kind, draw(st.integers(0, 2**16)), draw(big_ints())


def mutate_frames(frames: list[bytes], m: tuple[str, int, int], arena: Arena) -> list[bytes]:
    kind, pos, v = m
    if len(frames) != 2 or len(frames[1]) < 24:
        return frames  # an earlier mutation left nothing to patch
    head, body = frames[0], bytearray(frames[1])
    n_req = min(struct.unpack_from("<I", body, 4)[0], (len(body) - 24) // 32)
    if kind == "truncate":
        body = body[: pos % (len(body) + 1)]
    elif kind == "flip" and body:
        body[pos % len(body)] ^= (v % 255) + 1
    elif kind == "extend":
        body += bytes([v & 0xFF]) * (pos % 300)
    elif kind == "header_count":  # n_requests or n_tensors that disagree with the body, up to 2**32-1
        struct.pack_into("<I", body, 4 + 4 * (pos % 2), v & 0xFFFF_FFFF)
    elif kind == "record_field" and n_req:
        off = 24 + 32 * (pos % n_req) + REC_FIELDS["first_tensor" if pos % 2 else "n_tensors"]
        struct.pack_into("<I", body, off, v & 0xFFFF_FFFF)
    elif kind == "kind":
        head = P.ENVELOPE.pack(P.PROTOCOL_VERSION if pos % 2 else v & 0xFFFF, v % 64)
    elif kind == "frames":
        return [head, bytes(body), b"x"] if pos % 3 == 0 else ([bytes(body)] if pos % 3 == 1 else [b""])
    elif kind == "session":  # another session's id, with our token or with its own (which we cannot know)
        struct.pack_into("<I", body, 0, arena.victim.session_id if pos % 2 else v & 0xFFFF_FFFF)
    elif kind == "token":
        struct.pack_into("<Q", body, 16, v)
    return [head, bytes(body)]


@st.composite
def hostile_message(draw: st.DrawFn) -> dict[str, object]:
    n = draw(st.integers(1, 4))
    return {
        "models": draw(st.lists(st.sampled_from(["tiny", "small"]), min_size=n, max_size=n)),
        "slots": draw(st.permutations(range(SLOTS)))[:n],
        "fields": draw(st.lists(st.tuples(st.integers(0, n - 1), field_mutation()), max_size=3)),
        "bytes": draw(st.lists(byte_mutation(), max_size=2)),
        "headers": draw(st.lists(st.tuples(st.integers(0, SLOTS - 1), st.sampled_from(["state", "gen", "replay"]),
                                           big_ints()), max_size=2)),
    }


# -- the oracle ------------------------------------------------------------------------------------------
def expected_answers(frames: list[bytes], raw: RawClient) -> collections.Counter[int]:
    """Request ids the worker must answer (with any status): those of a decodable SUBMIT of our session."""
    try:
        if P.read_envelope(frames) != P.MsgKind.SUBMIT:
            return collections.Counter()
        batch = P.decode_submit(frames[1])
    except P.ProtocolError:
        return collections.Counter()
    if batch.session_id != raw.session_id or batch.token != raw.token:
        return collections.Counter()
    return collections.Counter(r.request_id for r in batch.requests)


def writable_spans(raw: RawClient, frames: list[bytes]) -> list[tuple[int, int]]:
    """Byte ranges the worker may write for this message: slot header and output region of named slots."""
    lay = raw.segment.layout
    named: set[int] = set()
    if len(frames) == 2 and len(frames[1]) >= 24:
        body = frames[1]
        n_req = min(struct.unpack_from("<I", body, 4)[0], (len(body) - 24) // 32)
        named = {struct.unpack_from("<I", body, 24 + 32 * i + 8)[0] for i in range(n_req)}
    spans = []
    for s in sorted(x for x in named if x < lay.n_slots):
        spans.append((lay.slot_bases[s], lay.slot_bases[s] + SLOT_HEADER_BYTES))
        spans.append((lay.output_bases[s], lay.output_bases[s] + lay.out_capacity))
    return spans


def outside(data: bytes, spans: list[tuple[int, int]]) -> bytes:
    parts, at = [], 0
    for a, b in spans:
        parts.append(data[at:a])
        at = b
    parts.append(data[at:])
    return b"".join(parts)


def run_one(arena: Arena, msg: dict[str, object]) -> None:
    raw = arena.sender
    models: list[str] = msg["models"]  # type: ignore[assignment]
    slots: list[int] = msg["slots"]  # type: ignore[assignment]
    reqs = [raw.prepare(s, m, X) for s, m in zip(slots, models, strict=True)]
    for i, (what, v) in msg["fields"]:  # type: ignore[attr-defined]
        mutate_request(reqs[i], what, v)
    for slot, what, v in msg["headers"]:  # type: ignore[attr-defined]
        base = raw.segment.layout.slot_bases[slot]
        if what == "state":
            struct.pack_into("<I", raw.segment.buf, base, v & 0xFFFF_FFFF)
        elif what == "gen":
            struct.pack_into("<I", raw.segment.buf, base + 4, v & 0xFFFF_FFFF)
        # "replay": leave the header; the request below repeats an old generation
    if any(w == "replay" for _s, w, _v in msg["headers"]):  # type: ignore[attr-defined]
        reqs[0].generation -= 1
    try:
        frames = P.encode_submit(P.SubmitBatch(raw.session_id, raw.token, reqs))
    except (P.ProtocolError, struct.error):
        return  # not encodable (e.g. a field past u64): nothing to send
    for m in msg["bytes"]:  # type: ignore[attr-defined]
        frames = mutate_frames(frames, m, arena)
    before = bytes(raw.segment.buf)
    want = expected_answers(frames, raw)
    raw.send_frames(frames)
    arena.messages += 1
    got: collections.Counter[int] = collections.Counter()
    while got != want:
        results = raw.recv(timeout=20)
        assert results is not None, f"worker did not answer {sorted((want - got).elements())}"
        for r in results:
            assert r.status in set(P.Status), r.status
            assert "shmb-" not in r.message and "/dev/shm" not in r.message, r.message
            got[r.request_id] += 1
        assert not got - want, f"answers nobody asked for: {got - want}"
    if not want:
        arena.dropped += 1
    spans = writable_spans(raw, frames)
    assert outside(bytes(raw.segment.buf), spans) == outside(before, spans), "worker wrote outside named slots"
    assert bytes(arena.victim.segment.buf) == arena.victim_bytes, "worker wrote into another session's ring"


def check_after(arena: Arena) -> None:
    b = arena.broker
    assert b.proc.poll() is None and b.worker_pids() == [arena.worker_pid], "the worker did not stay up"
    assert b.stats().workers[0].restarts == 0
    raw = arena.sender
    raw.send(raw.prepare(0, "tiny", X))
    (r,) = raw.recv() or []
    assert r.status == P.Status.OK, r.message
    np.testing.assert_allclose(raw.output(r, "tiny"), direct("tiny", X), rtol=0, atol=1e-5)
    with Client(b.runtime_dir) as c:
        np.testing.assert_allclose(arr(c.infer("tiny", X)), direct("tiny", X), rtol=0, atol=1e-5)
    # dropped messages are logged at most once per 5 s (RateLimitedLog), never once per message
    drops = len(re.findall(r"dropped a (malformed data message|SUBMIT for session)", b.log_path.read_text()))
    assert drops <= (time.monotonic() - arena.started) / 5 + 2, (drops, arena.dropped)
    assert arena.dropped > 10 * drops, (drops, arena.dropped)
    print(f"hostile: {arena.messages} messages, {arena.dropped} dropped, {drops} log lines, worker up")


def _fuzz(arena: Arena, examples: int) -> None:
    @settings(max_examples=examples, deadline=None, database=None, derandomize=False,
              suppress_health_check=list(HealthCheck))
    @given(hostile_message())
    def fuzz(msg: dict[str, object]) -> None:
        run_one(arena, msg)

    fuzz()
    check_after(arena)


def test_hostile_messages_short(arena: Arena) -> None:
    """Default CI: a few hundred mutated messages."""
    _fuzz(arena, 300)
    assert arena.messages >= 250


@pytest.mark.long
def test_hostile_messages_10k(arena: Arena) -> None:
    start = arena.messages
    _fuzz(arena, 10_500)
    assert arena.messages - start >= 10_000
