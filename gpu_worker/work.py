"""A checked request on its way through a worker (``Work``), the per-model counters, and the two ways a batch's
requests are answered (``complete_ok``, ``reply``): what every runner, the intake and the copies share."""

from __future__ import annotations

import threading
from collections import Counter, defaultdict
from dataclasses import dataclass

from shmbroker.broker.common import protocol as P
from shmbroker.broker.common.protocol import SlotState
from shmbroker.gpu_worker.codec import ModelCodec
from shmbroker.gpu_worker.histogram import Histogram
from shmbroker.gpu_worker.sessions import WorkerSession

_STATUS_NAMES = {s: s.name for s in P.Status}


@dataclass(slots=True)
class Work:
    """A checked request waiting for, or in, a batch (the batcher's entry); its slot is claimed in
    ``session.in_flight``."""

    session: WorkerSession
    req: P.SubmitRequest
    rows: int
    deadline: float  # time.monotonic() seconds
    enqueued: float


class ModelCounters:
    """Per-model counters: requests by status, batches by row count. Written by the intake and runner threads.

    ``stages`` holds the GPU pipeline's timing histograms (empty for a CPU model); it is filled before the
    runner starts and only read afterwards.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: Counter[str] = Counter()
        self.batch_rows: Counter[int] = Counter()
        self.stages: dict[str, Histogram] = {}
        self.decoder = ""  # a model of images: its decoder and where it runs (ModelStats.decoder)

    def count(self, status: P.Status, n: int = 1) -> None:
        name = _STATUS_NAMES[status]  # Enum.name is a property: a dict lookup is cheaper per batch
        with self._lock:
            self.requests[name] += n

    def batch(self, rows: int) -> None:
        with self._lock:
            self.batch_rows[rows] += 1

    def snapshot(self, name: str, queue_depth: int) -> P.ModelStats:
        stages = {k: h.snapshot() for k, h in self.stages.items()}
        with self._lock:
            return P.ModelStats(
                name=name, requests=dict(self.requests), batches=sum(self.batch_rows.values()),
                batch_items={str(k): v for k, v in sorted(self.batch_rows.items())}, queue_depth=queue_depth,
                stages=stages, decoder=self.decoder,
            )


def reply(works: list[Work], status: P.Status, message: str) -> None:
    """Answer each request with an error: mark its slot FAILED, send one DONE per session, free the slots."""
    by_session: dict[WorkerSession, list[P.Result]] = defaultdict(list)
    for w in works:
        by_session[w.session].append(P.Result(w.req.request_id, w.req.slot, w.req.generation, status, [], message))
    for session, results in by_session.items():
        session.finish([r.slot for r in results], SlotState.FAILED, status,
                       P.encode_done(P.DoneBatch(session.session_id, results)))


def complete_ok(codec: ModelCodec, counters: ModelCounters, works: list[Work]) -> None:
    """Answer a batch whose outputs are already in each request's slot (canonical offsets): state DONE, one
    DONE message per session, slots freed with it."""
    done: dict[WorkerSession, list[Work]] = defaultdict(list)
    for w in works:
        done[w.session].append(w)
    counters.count(P.Status.OK, len(works))
    for session, items in done.items():
        session.finish([w.req.slot for w in items], SlotState.DONE, P.Status.OK,
                       codec.done_ok(session.session_id, items))
