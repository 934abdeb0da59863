"""The worker's logic: intake of SUBMITs, control messages from the broker. Runs in any thread.

The IO loop (this class) owns the data PULL socket and the control DEALER; each model's runner thread
owns its batches. The models come from ``gpu_worker.models``. ``gpu_worker.__main__`` wraps this in a
process; the broker's thread mode runs it inline.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
from pathlib import Path

import msgspec
import zmq

from shmbroker.broker.common import protocol as P
from shmbroker.broker.common import runtime
from shmbroker.broker.common.config import Config
from shmbroker.broker.common.peergate import PeerGate
from shmbroker.broker.common.protocol import STATE_GEN, SUBMIT_ENVELOPE, TENSOR_ROWS, TENSOR_ROWS_AT, SlotState
from shmbroker.broker.common.ratelog import RateLimitedLog
from shmbroker.broker.common.ring import RingError
from shmbroker.broker.common.spin import SpinPolicy
from shmbroker.gpu_worker.hints import Watch, hinted_submit
from shmbroker.gpu_worker.intake import Rejected, check_slot, check_tensors
from shmbroker.gpu_worker.models import ServedModel, build_models, model_info, overloaded_message
from shmbroker.gpu_worker.sessions import WorkerSession, map_ring
from shmbroker.gpu_worker.work import Work, reply

log = logging.getLogger(__name__)

POLL_MS = 20
INLINE_BATCHES = 8  # due batches of a cheap model run inline per wake-up; the runner takes any left
SWEEP_S = 0.002  # how often queued requests are checked for expired deadlines
SUBMITTED = int(SlotState.SUBMITTED)  # a plain int: compared once per request on the hot path
DATA_DOMAIN = "data"  # the data socket's ZAP domain (broker.common.peergate)


class Worker:
    """Invariant: every SUBMIT entry that names a live session is answered exactly once (DONE with a status)."""

    def __init__(self, cfg: Config, worker_id: int, runtime_dir: Path, restarts: int = 0) -> None:
        self.cfg = cfg
        self.worker_id = worker_id
        self.device = str(cfg.worker.devices[worker_id])
        self.runtime_dir = runtime_dir
        self.restarts = restarts
        self.endpoint = runtime.worker_endpoint(runtime_dir, worker_id)
        self.models: dict[int, ServedModel] = {}
        self.sessions: dict[int, WorkerSession] = {}
        self._detaching: set[int] = set()
        self._watch: Watch | None = None  # where the spin looks for a hinted request (gpu_worker.hints)
        self._watching = False  # a runner may hold a lone device batch whose end the spin polls (_spin)
        self._next_sweep = 0.0
        self._badlog = RateLimitedLog(log)
        # SUBMITs dropped without an answer, by P.DropReason: STATS shows them, so a client whose requests are
        # never answered can see why (counted on the drop paths only, never on the fast path)
        self.dropped: dict[str, int] = {}
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        # Each reply socket admits its session's client's uid only; the data socket, any uid that can open it.
        # Both pace each uid's connections: a session has one of each, so a uid's sessions reconnect at once
        # after a restart, and a uid whose connections ZeroMQ drops in a loop waits for its turn.
        self._gate = PeerGate(self._ctx, burst=2 * cfg.sessions.max_sessions_per_uid)
        self._gate.allow(DATA_DOMAIN, None)
        self._ctl = self._ctx.socket(zmq.DEALER)
        self._data = self._ctx.socket(zmq.PULL)
        for s in (self._ctl, self._data):
            s.setsockopt(zmq.LINGER, 0)
        self._data.setsockopt(zmq.RCVHWM, 0)
        self._data.setsockopt(zmq.ZAP_DOMAIN, DATA_DOMAIN.encode())
        # Built once: Socket.poll() builds a Poller per call, and it and get(EVENTS) each cost twice a poll of
        # this one (bench/RESULTS.md#slot-header-answers-yielding-spinners-submit-hints).
        self._data_ready = zmq.Poller()
        self._data_ready.register(self._data, zmq.POLLIN)

    # -- lifecycle -----------------------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> int:
        """Load models, say READY to the broker, then serve until ``stop`` or SHUTDOWN. Returns an exit code."""
        self._ctl.connect(runtime.endpoint(self.runtime_dir, runtime.WORKERS_SOCKET))
        self._send_ctl(P.WorkerHello(P.PROTOCOL_VERSION, self.worker_id, os.getpid()))
        try:
            self.models = build_models(self.cfg, self.device, self._progress)
        except Exception as exc:  # noqa: BLE001 - any load failure is reported to the broker (health shows it)
            log.error("worker %d could not load its models: %s", self.worker_id, exc)
            self._send_ctl(P.WorkerFailed(self.worker_id, f"{type(exc).__name__}: {exc}"))
            self._close()
            return 3
        # ZeroMQ closes the connection of a client that sends a frame over the largest legal SUBMIT before
        # reading it into memory: an 88 MB one would otherwise be read and decoded, whatever its token
        n_inputs = max(len(m.view.inputs) for m in self.models.values())
        self._data.setsockopt(zmq.MAXMSGSIZE, P.max_submit_bytes(n_inputs))
        self._data.bind(self.endpoint)
        runtime.secure_socket_file(self.endpoint, self.cfg.file_mode, self.cfg.group_id())
        for m in self.models.values():
            m.runner.start()
        infos = [model_info(m.view) for m in self.models.values()]
        if self.cfg.broker.worker_mode == "process":
            # everything loaded so far lives as long as the worker: keep it out of the collector's scans, so a
            # full collection does not pause the serving loop for the engines' and libraries' objects
            gc.freeze()
        self._send_ctl(P.WorkerReady(self.worker_id, self.endpoint, infos))
        try:
            self._serve(stop)
        finally:
            self._close()
        return 0

    def _serve(self, stop: threading.Event) -> None:
        """(1) spin, (2) poll and intake, (3) inline batches, (4) control, (5) sweep."""
        poller = zmq.Poller()
        poller.register(self._data, zmq.POLLIN)
        poller.register(self._ctl, zmq.POLLIN)
        parent = os.getppid()
        # Only a worker process spins: in thread mode the loop shares the broker's GIL.
        spin = SpinPolicy(self.cfg.worker.spin_us * 1000 if self.cfg.broker.worker_mode == "process" else 0)
        # a spinning loop also polls the end of a lone device batch it launched
        watch = spin.spin_ns > 0 and any(m.runner.watches_ends for m in self.models.values())
        while not stop.is_set():
            hinted = self._spin(spin) if spin.until else False  # (1)
            if self._watching:  # before this loop sleeps, the completion threads take the watched batches
                self._unwatch()
            if hinted:  # its caller is waiting: run it (3) before the poll, which costs tens of us on a cold core
                spin.arrived(time.perf_counter_ns())
                if self._run_inline(watch):
                    spin.waiting(time.perf_counter_ns())
            events = dict(poller.poll(0 if hinted else POLL_MS))  # (2)
            if self._data in events:
                spin.arrived(time.perf_counter_ns())
                self._drain_data()
                if self._run_inline(watch):  # (3) not after slow models: their runner threads need the cores
                    spin.waiting(time.perf_counter_ns())
            if self._ctl in events and not self._drain_control():  # (4)
                return
            self._sweep()  # (5)
            # a backup for the parent-death signal, checked when idle so no syscall is added per message
            if not events and not hinted and self.cfg.broker.worker_mode == "process" and os.getppid() != parent:
                log.error("the broker (pid %d) is gone; worker %d exits", parent, self.worker_id)
                return

    def _run_inline(self, watch: bool) -> int:
        """Run due batches of cheap models on this thread (up to INLINE_BATCHES each); returns how many ran.
        ``watch``: this loop spins next, polling the end of a lone device batch it launched (``_spin``)."""
        ran = 0
        for m in self.models.values():
            runner = m.runner
            for _ in range(INLINE_BATCHES):
                if not len(runner.batcher) or not runner.try_inline(watch):  # an empty queue needs no lock
                    break
                ran += 1
            else:
                runner.batcher.kick()  # still more due: the runner thread takes the rest
        self._watching = self._watching or (watch and ran > 0)
        return ran

    def _ends_seen(self) -> bool:
        """Answer the watched lone batches that have ended (BatchRunner.end_seen); True if any was."""
        seen = False
        for m in self.models.values():
            seen = m.runner.end_seen() or seen
        return seen

    def _unwatch(self) -> None:
        for m in self.models.values():
            m.runner.unwatch()
        self._watching = False

    def _spin(self, spin: SpinPolicy) -> bool:
        """Poll the data socket without sleeping until a message is there or ``spin.until`` passes.

        Why: on small and virtual machines a core woken from sleep runs the next request two to three
        times slower (cold caches, a slow wake-up), which dominates the round trip of cheap models.
        ``SpinPolicy`` sets ``until``: at most ``worker.spin_us`` after an inline batch, and only while
        most requests came within that window, so an idle or busy machine's worker sleeps. It also
        answers a lone device batch that it launched once that ends, and spins on from there, since the
        next request comes a round trip after its answer; and it admits a request hinted in the watched
        slot (gpu_worker.hints); returns whether it did.
        """
        clock = time.perf_counter_ns
        ready = self._data_ready.poll
        while clock() < spin.until:
            if self._watching and self._ends_seen():
                spin.waiting(clock())
            if ready(0):
                return False
            if self._watch is not None and self._take_hint(self._watch):
                return True
            # Give the core to any thread that is ready (ZeroMQ's IO threads carry the next request in): on
            # a small machine the scheduler would otherwise let a spinner finish its slice first, and the
            # request would wait the whole spin window.
            os.sched_yield()
        return False

    def _take_hint(self, w: Watch) -> bool:
        """Admit the request hinted in the watched slot, as if its SUBMIT had come; its SUBMIT is dropped later."""
        body = hinted_submit(w, self.worker_id)
        if body is None or not self._fast_submit(body):
            return False
        w.session.note_hinted(w.slot, w.generation)
        w.session.segment.clear_hint(w.slot)  # the client, if it still waits to see this, sends no SUBMIT
        return True

    def _close(self) -> None:
        for m in self.models.values():
            m.runner.stop()
            m.engine.close()
        for s in self.sessions.values():
            s.close()
        self.sessions.clear()
        runtime.remove_socket_file(self.endpoint)
        self._gate.close()
        self._ctx.destroy(linger=1000)  # lets a last WORKER_FAILED reach the broker

    # -- data plane ----------------------------------------------------------------------------------------
    def _drain_data(self) -> None:
        """Take the SUBMITs waiting on the data socket; called once poll said at least one is there."""
        for i in range(256):  # bounded, so control messages are not starved
            if i and not self._data_ready.poll(0):  # cheaper than a zmq.Again per drain
                return
            try:
                frames = self._data.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:  # the sender's connection ended in the middle of it: nothing to take
                return
            self.on_submit(frames)

    def on_submit(self, frames: list[bytes]) -> None:
        """Check and queue every request of one SUBMIT; answer the rejected ones at once."""
        if len(frames) == 2 and frames[0] == SUBMIT_ENVELOPE and self._fast_submit(frames[1]):
            return
        try:
            if P.read_envelope(frames) != P.MsgKind.SUBMIT:
                raise P.ProtocolError("the data socket takes only SUBMIT")
            sid, token = P.submit_sender(frames[1])
        except P.ProtocolError as exc:
            self._drop(P.DropReason.MALFORMED)
            self._badlog.warning("dropped a malformed data message: %s", exc)
            return
        # the header's session and token first (PROTOCOL 6: M6 before M3-M5): a message without the session's
        # token is dropped for the cost of a header, never decoded
        session = self.sessions.get(sid)
        if session is None or session.token != token or session.detaching:
            reason = (P.DropReason.UNKNOWN_SESSION if session is None else
                      P.DropReason.WRONG_TOKEN if session.token != token else P.DropReason.DETACHING)
            self._drop(reason)
            self._badlog.warning("dropped a SUBMIT for session %d: unknown, detaching, or wrong token", sid)
            return
        try:
            batch = P.decode_submit(frames[1])
        except P.ProtocolError as exc:
            self._drop(P.DropReason.MALFORMED)
            self._badlog.warning("dropped a malformed data message: %s", exc)
            return
        rejected: list[P.Result] = []
        freed: list[int] = []  # slots this message claimed and that are answered now, and their statuses
        statuses: list[int] = []
        now = time.monotonic()
        for req in batch.requests:
            if session.hinted.pop((req.slot, req.generation), False):
                continue  # admitted from its hint already
            if session.late_hinted(req.slot, req.generation):
                self._drop(P.DropReason.LATE_HINTED)
                log.debug("session %d slot %d: late SUBMIT of generation %d, taken from its hint, dropped",
                          session.session_id, req.slot, req.generation)
                continue
            try:
                self._admit(session, req, now)
            except Rejected as rej:
                rejected.append(P.Result(req.request_id, req.slot, req.generation, rej.status, [], rej.message))
                if rej.claimed:  # an unclaimed slot's header belongs to a request in flight: not touched
                    freed.append(req.slot)
                    statuses.append(rej.status)
        if rejected:
            session.finish(freed, SlotState.FAILED, statuses, P.encode_done(P.DoneBatch(session.session_id,
                                                                                         rejected)))

    def _drop(self, reason: str) -> None:
        """Count a SUBMIT (or an entry of one) dropped without an answer; STATS reports the counts."""
        self.dropped[reason] = self.dropped.get(reason, 0) + 1

    def _fast_submit(self, body: bytes) -> bool:
        """Admit a whole SUBMIT whose every request is canonical (protocol.CanonicalRows); False: no request was
        admitted and the message takes the detailed path, which answers each fault with its own status."""
        if len(body) < P.SUBMIT_HEADER.size:
            return False
        sid, n_req, n_t, _flags, token = P.SUBMIT_HEADER.unpack_from(body)
        t_base = P.SUBMIT_HEADER.size + P.REQUEST.size * n_req
        session = self.sessions.get(sid)
        if len(body) != t_base + P.TENSOR.size * n_t or session is None or session.token != token:
            return False
        buf, bases, max_items = session.segment.buf, session.layout.slot_bases, session.max_items
        n_slots = len(bases)
        now = time.monotonic()
        # per model: its entries in order; queued only once every request passed
        by_model: dict[int, tuple[ServedModel, list[Work]]] = {}
        slots = []
        hinted = session.hinted
        taken = []  # requests of this message already admitted from their hint: dropped
        records = body[P.SUBMIT_HEADER.size : t_base]
        t_size = P.TENSOR.size
        # the model of the previous record and what the checks need of it: a message's requests are
        # mostly for one model, so most records skip these lookups
        last_id = -1
        n_in = 0
        canons: dict[int, P.CanonicalRows] = {}
        default_s = 0.0
        entries: list[Work] = []
        for rid, slot, gen, model_id, first, count, timeout_us in P.REQUEST.iter_unpack(records):
            if hinted and (slot, gen) in hinted and (slot, gen) not in taken:  # a repeat is checked, as stale
                taken.append((slot, gen))
                continue
            if model_id != last_id:
                m = self.models.get(model_id)
                if m is None:
                    return False
                last_id, n_in, canons = model_id, m.runner.codec.n_inputs, m.runner.codec.intake
                default_s = m.view.timeout_ms / 1e3
                group = by_model.get(model_id)
                if group is None:
                    group = by_model[model_id] = (m, [])
                entries = group[1]
            if slot >= n_slots or count != n_in or first > n_t or count > n_t - first:
                return False
            start = t_base + t_size * first
            rows = TENSOR_ROWS.unpack_from(body, start + TENSOR_ROWS_AT)[0]
            canon = canons.get(rows)
            # in_desc_bytes is exactly count descriptors long: startswith compares them in place, without a copy
            if canon is None or rows > max_items or not body.startswith(canon.in_desc_bytes, start):
                return False
            state, generation = STATE_GEN.unpack_from(buf, bases[slot])
            if state != SUBMITTED or generation != gen:
                return False
            entries.append(Work(session, P.SubmitRequest(rid, slot, gen, model_id, timeout_us, canon.in_descs), rows,
                                now + (timeout_us / 1e6 if timeout_us else default_s), now))
            slots.append(slot)
        if session.detaching or not session.claim_slots(slots):
            return False
        for key in taken:
            del hinted[key]
        if n_req == 1 and slots:  # one request at a time: its client will reuse the slot it gets back
            _model, first_entries = next(iter(by_model.values()))
            req = first_entries[0].req
            self._watch = Watch(session, req.slot, (req.generation + 1) & 0xFFFF_FFFF)
        elif slots:  # requests coalesced: batches matter more than one round trip, and a hint would be a
            self._watch = None  # batch of one taken ahead of the rest
        for m, entries in by_model.values():
            fitted = m.runner.batcher.put_many(entries, wake=not m.runner.cheap)
            if fitted < len(entries):
                m.runner.counters.count(P.Status.OVERLOADED, len(entries) - fitted)
                reply(entries[fitted:], P.Status.OVERLOADED,
                      overloaded_message(m.view.name, m.runner.batcher.max_queue_size))
        return True

    def _admit(self, session: WorkerSession, req: P.SubmitRequest, now: float) -> None:
        """Queue one request, or raise Rejected (``claimed`` set when the slot was taken)."""
        model = self.models.get(req.model_id)
        if model is None:
            raise Rejected(P.Status.UNKNOWN_MODEL, f"model_id {req.model_id} is not served by this worker")
        counters = model.runner.counters
        try:
            check_slot(session, req)
            rows = check_tensors(session, req, model.view)
        except Rejected as rej:
            counters.count(rej.status)
            raise
        timeout = req.timeout_us / 1e6 if req.timeout_us else model.view.timeout_ms / 1e3
        entry = Work(session, req, rows, now + timeout, now)
        if not model.runner.batcher.put(entry, wake=not model.runner.cheap):
            counters.count(P.Status.OVERLOADED)
            message = overloaded_message(model.view.name, model.runner.batcher.max_queue_size)
            raise Rejected(P.Status.OVERLOADED, message, claimed=True)

    def _sweep(self) -> None:
        """Answer queued requests whose deadline passed, and finish detaches that waited for in-flight work."""
        now = time.monotonic()
        if now < self._next_sweep:
            return
        self._next_sweep = now + SWEEP_S
        for m in self.models.values():
            m.runner.answer_expired(m.runner.batcher.expire(now), P.Status.TIMEOUT,
                                    f"deadline passed while queued for model {m.view.name!r}")
        for session in self.sessions.values():
            session.flush_outbox()
        for sid in list(self._detaching):
            s = self.sessions.get(sid)
            if s is None or s.idle:
                self._detaching.discard(sid)
                if s is not None:
                    if self._watch is not None and self._watch.session is s:
                        self._watch = None  # its segment is about to be unmapped
                    s.close()
                    del self.sessions[sid]
                self._send_ctl(P.DetachOk(sid))

    # -- control plane -------------------------------------------------------------------------------------
    def _drain_control(self) -> bool:
        while True:
            try:
                frames = self._ctl.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return True
            try:
                msg = P.decode(frames)
            except P.ProtocolError as exc:
                log.error("bad control message from the broker: %s", exc)
                continue
            if isinstance(msg, P.Shutdown):
                log.info("worker %d shutting down on the broker's request", self.worker_id)
                return False
            self._on_control(msg)

    def _on_control(self, msg: object) -> None:
        if isinstance(msg, P.Attach):
            self._attach(msg)
        elif isinstance(msg, P.Detach):
            s = self.sessions.get(msg.session_id)
            if s is not None:
                s.detaching = True
                self._drop_queued(s)
            self._detaching.add(msg.session_id)
        elif isinstance(msg, P.WorkerStatsRequest):
            self._send_ctl(P.WorkerStatsReply(msg.request_id, self.stats()))
        else:
            log.error("unexpected control message %s", type(msg).__name__)

    def _drop_queued(self, s: WorkerSession) -> None:
        """A closing session's requests that wait in a queue are dropped, not run: its client said BYE or died.
        Those already in a batch finish (the DETACH waits for them), so nothing writes to an unmapped ring."""
        for m in self.models.values():
            gone = m.runner.batcher.remove(lambda w: w.session is s)
            if gone:
                log.info("session %d closing: %d queued requests for model %s dropped", s.session_id, len(gone),
                         m.view.name)
                m.runner.answer_expired(gone, P.Status.BAD_SESSION, "the session was closed before the request ran")

    def _attach(self, msg: P.Attach) -> None:
        if msg.session_id in self.sessions:
            self._send_ctl(P.AttachOk(msg.session_id, self.sessions[msg.session_id].reply_endpoint))
            return
        try:
            ring = map_ring(self.runtime_dir, msg, self.cfg.broker.handshake_timeout_ms / 1e3)
            s = WorkerSession(self._ctx, msg, ring, self.worker_id, self.runtime_dir, self.cfg.file_mode,
                              self.cfg.group_id(), self._gate)
        except (OSError, RingError, zmq.ZMQError) as exc:
            log.error("cannot attach session %d: %s", msg.session_id, exc)
            self._send_ctl(P.AttachFailed(msg.session_id, str(exc)))
            return
        self.sessions[msg.session_id] = s
        self._send_ctl(P.AttachOk(msg.session_id, s.reply_endpoint))

    def stats(self) -> P.WorkerStats:
        models = [m.runner.counters.snapshot(m.view.name, len(m.runner.batcher)) for m in self.models.values()]
        in_flight = sum(len(s.in_flight) for s in self.sessions.values())
        return P.WorkerStats(self.worker_id, os.getpid(), self.restarts, models, in_flight, self.device,
                             dict(self.dropped))

    def _progress(self, step: str) -> None:
        """Tell the broker the next step of this worker's start: its start deadline counts from the latest."""
        self._send_ctl(P.WorkerProgress(self.worker_id, step))

    def _send_ctl(self, msg: msgspec.Struct) -> None:
        self._ctl.send_multipart(P.encode(msg))
