"""Submit hints: a request copied into its slot header, which a spinning worker takes before the SUBMIT comes.

A client writes the SUBMIT record and descriptors of a request into the slot header (PROTOCOL 4.2) before
it publishes the slot, and then sends the SUBMIT, unless it sees the hint taken first. A worker that is
spinning watches the slot it expects next (the one it just answered, one generation on) and admits the
hinted request from there, which saves the message's trip through both ZeroMQ IO threads, then clears the
hint word. A SUBMIT that follows anyway is dropped (``taken``).
Everything in a hint is checked exactly like a message, by the same code.
"""

from __future__ import annotations

from dataclasses import dataclass

from shmbroker.broker.common import protocol as P
from shmbroker.broker.common.protocol import HINT, HINT_AT, HINT_CAPACITY, HINT_RECORD_AT, STATE_GEN, SlotState
from shmbroker.gpu_worker.sessions import WorkerSession


@dataclass(slots=True)
class Watch:
    """The slot and generation a session's next request is expected in (its client reuses a freed slot)."""

    session: WorkerSession
    slot: int
    generation: int


def hinted_submit(w: Watch, worker_id: int) -> bytes | None:
    """The SUBMIT body of the hinted request in ``w``'s slot, if the client published that generation with a
    hint for this worker; else None. The state word is read first (the client writes it last)."""
    buf = w.session.segment.buf
    base = w.session.layout.slot_bases[w.slot]
    state, generation = STATE_GEN.unpack_from(buf, base)
    if state != SlotState.SUBMITTED or generation != w.generation:
        return None
    n, hinted_worker = HINT.unpack_from(buf, base + HINT_AT)
    if hinted_worker != worker_id or not P.REQUEST.size <= n <= HINT_CAPACITY:
        return None
    record = bytes(buf[base + HINT_RECORD_AT : base + HINT_RECORD_AT + n])
    _rid, slot, gen, _model, first, count, _timeout = P.REQUEST.unpack_from(record)
    if slot != w.slot or gen != w.generation or first != 0 or n != P.REQUEST.size + P.TENSOR.size * count:
        return None
    return P.submit_body(w.session.session_id, w.session.token, [record], [], count)  # record holds the descs
