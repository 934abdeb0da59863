"""A worker's view of one client session: its mapped ring, its reply socket and its slots in flight."""

from __future__ import annotations

import collections
import logging
import secrets
import threading
from pathlib import Path

import numpy as np
import zmq

from shmbroker.broker.common import protocol as P
from shmbroker.broker.common import runtime
from shmbroker.broker.common.handout import fetch_ring
from shmbroker.broker.common.peergate import PeerGate
from shmbroker.broker.common.ring import RingLayout, Segment

log = logging.getLogger(__name__)

CLOSE_LINGER_MS = 200  # lets last answers (SHUTTING_DOWN) leave when a session or the worker closes


def map_ring(runtime_dir: Path, msg: P.Attach, timeout_s: float) -> Segment:
    """The session's ring, from the broker's handout (within ``timeout_s``, the handshake's), checked against
    the layout ``msg`` announces."""
    layout = RingLayout.of(msg)
    return Segment.from_fd(fetch_ring(runtime_dir, msg.session_id, msg.token, timeout_s), layout)


class WorkerSession:
    """Invariant: a slot is in ``in_flight`` from intake until its state word says DONE or FAILED; release
    waits for none left."""

    def __init__(
        self, ctx: zmq.Context[zmq.Socket[bytes]], msg: P.Attach, segment: Segment, worker_id: int,
        runtime_dir: Path, mode: int, gid: int | None, gate: PeerGate,
    ) -> None:
        """Serve ``msg``'s session on ``segment`` (``map_ring``'s, owned from now on) with a new reply socket."""
        self.session_id = msg.session_id
        self.token = msg.token
        self.max_items = msg.max_items
        self.segment = segment
        self.layout = segment.layout
        self.in_flight: set[int] = set()
        # (slot, generation) of requests admitted from their submit hint whose SUBMIT has not come yet, oldest
        # first; an entry goes when its SUBMIT comes (gpu_worker.hints)
        self.hinted: dict[tuple[int, int], bool] = {}
        self.hint_high: dict[int, int] = {}  # slot -> the generation of its latest request taken from a hint
        self.detaching = False
        # views of a slot's tensors at their canonical offsets, by (model_id, slot, rows): (inputs by name,
        # outputs), built at the slot's first one-request batch and reused (gpu_worker.runner); dropped before
        # the ring is unmapped
        self.views: dict[tuple[int, int, int], tuple[dict[str, np.ndarray], list[np.ndarray]]] = {}
        self._lock = threading.Lock()
        # page-locked for DMA (cudaHostRegister) by a GPU worker at first use; never on a CPU worker
        self._registered = False
        self._register_failed = False
        self._register_lock = threading.Lock()
        # DONEs that could not leave yet (the client's reply connection is not up): the IO thread
        # retries them. Bounded by the ring: each holds at least one of the session's slots' answers.
        self._outbox: collections.deque[list[bytes]] = collections.deque()
        name = runtime.reply_socket_name(worker_id, msg.session_id, secrets.token_hex(6))
        self.reply_endpoint = runtime.endpoint(runtime_dir, name)
        self._gate, self._domain = gate, f"reply-{name}"
        gate.allow(self._domain, frozenset({msg.client_uid}))  # answers go to the session's client's user only
        self._sock = ctx.socket(zmq.PUSH)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 0)  # bounded by the ring's slots, not by ZeroMQ
        self._sock.setsockopt(zmq.ZAP_DOMAIN, self._domain.encode())
        try:
            self._sock.bind(self.reply_endpoint)
            runtime.secure_socket_file(self.reply_endpoint, mode, gid)
        except BaseException:
            self._sock.close()
            gate.forget(self._domain)
            self.segment.close()
            raise

    def finish(self, slots: list[int], state: int, statuses: int | list[int], frames: list[bytes]) -> None:
        """Answer claimed slots in one step under the session lock: free the claims, write each slot's status
        (one for all, or one each) and ``state`` word, queue the DONE.

        Claims are freed before the state words are written: a client that reads DONE in the slot header
        (client.lead) reuses the slot at once, and its next SUBMIT must find the slot unclaimed; intake
        claims under the same lock, so it sees both changes or neither. Never blocks: a DONE that cannot
        leave now (no reply connection yet) waits in the outbox.
        """
        with self._lock:
            self.in_flight.difference_update(slots)
            self.segment.set_states(slots, state, statuses)
            if self._outbox or not self._try_send(frames):
                self._outbox.append(frames)

    def flush_outbox(self) -> None:
        """Retry DONEs that could not leave (called by the IO thread on every turn)."""
        if not self._outbox:
            return
        with self._lock:
            while self._outbox and self._try_send(self._outbox[0]):
                self._outbox.popleft()

    def _try_send(self, frames: list[bytes]) -> bool:
        try:
            self._sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
            return True
        except zmq.Again:
            return False

    def note_hinted(self, slot: int, generation: int) -> None:
        """Remember a request admitted from its hint until its SUBMIT comes. Bounded by twice the slots: for a
        client that never sends the SUBMIT (against the protocol) the oldest entry goes; a SUBMIT later than that
        is still recognised by the slot's latest hint-taken generation (``late_hinted``), never run twice."""
        self.hinted[(slot, generation)] = True
        self.hint_high[slot] = generation
        if len(self.hinted) > 2 * self.layout.n_slots:
            del self.hinted[next(iter(self.hinted))]

    def late_hinted(self, slot: int, generation: int) -> bool:
        """A SUBMIT entry that comes after its slot moved past it, for a generation at or before the slot's
        latest one taken from a hint: a request answered long ago whose SUBMIT the client sent before it saw
        the hint taken (PROTOCOL 4.2). Dropped without an answer, however late."""
        high = self.hint_high.get(slot)
        if high is None:
            return False
        _state, current = P.STATE_GEN.unpack_from(self.segment.buf, self.layout.slot_bases[slot])
        return current != generation and (high - generation) & 0xFFFF_FFFF < 1 << 31

    def claim_slots(self, slots: list[int]) -> bool:
        """Claim all of them, or (one is in flight or named twice) none."""
        claim = set(slots)
        with self._lock:
            if len(claim) != len(slots) or not self.in_flight.isdisjoint(claim):
                return False
            self.in_flight |= claim
            return True

    def claim_slot(self, slot: int) -> bool:
        return self.claim_slots([slot])

    @property
    def idle(self) -> bool:
        with self._lock:
            return not self.in_flight

    def ensure_registered(self) -> bool:
        """Page-lock the whole segment with cudaHostRegister, once; the GPU pipeline calls this before a copy.

        Returns whether the segment is registered. A refusal (logged once) leaves it pageable: copies stay
        correct, only slower, since the driver then stages them through its own pinned buffers.
        """
        if self._registered or self._register_failed:
            return self._registered
        from shmbroker.gpu_worker import cuda

        with self._register_lock:
            if not (self._registered or self._register_failed):
                try:
                    cuda.host_register(self.segment.address, self.segment.nbytes)
                    self._registered = True
                except cuda.CudaError as exc:
                    self._register_failed = True
                    log.error("session %d: cudaHostRegister of its %d-byte ring failed (%s); its copies go "
                              "from pageable memory", self.session_id, self.segment.nbytes, exc.name)
        return self._registered

    def close(self) -> None:
        """Close the reply socket, unregister the ring (GPU), unmap it. Called once the session is idle."""
        with self._lock:
            self._sock.close(linger=CLOSE_LINGER_MS)
            runtime.remove_socket_file(self.reply_endpoint)
        self._gate.forget(self._domain)
        self._unregister()
        self.views.clear()
        self.segment.close()

    def _unregister(self) -> None:
        with self._register_lock:
            if not self._registered:
                return
            from shmbroker.gpu_worker import cuda

            self._registered = False
            try:
                cuda.host_unregister(self.segment.address)
            except cuda.CudaError as exc:  # logged; the segment is unmapped regardless
                log.error("session %d: cudaHostUnregister failed: %s", self.session_id, exc.name)
