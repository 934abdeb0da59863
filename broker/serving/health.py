"""Readiness: a model is ready when at least one worker that serves it passed its warm-up."""

from __future__ import annotations

import time

from shmbroker.broker.common import protocol as P
from shmbroker.broker.common.config import Config
from shmbroker.broker.serving.supervisor import Supervisor, WorkerPhase, WorkerSlot


def health_reply(cfg: Config, sup: Supervisor) -> P.HealthReply:
    models = []
    for name in cfg.models:
        total = len(sup.workers)
        ready = sum(1 for w in sup.workers if w.phase is WorkerPhase.READY and any(m.name == name for m in w.models))
        reasons = sorted({w.reason for w in sup.workers if w.reason and w.phase is not WorkerPhase.READY})
        models.append(P.ModelHealth(name, ready > 0, ready, total, "; ".join(reasons)))
    not_ready = [m for m in models if not m.ready]
    reason = ""
    if not_ready:
        phases = ", ".join(_phase(w, time.monotonic()) for w in sup.workers)
        why = next((m.reason for m in not_ready if m.reason), "")
        reason = f"models not ready: {', '.join(m.name for m in not_ready)} ({phases}){': ' + why if why else ''}"
    return P.HealthReply(not not_ready, models, reason)


def _phase(w: WorkerSlot, now: float) -> str:
    """``worker K starting`` with its step and how long the start has taken, or ``worker K ready`` etc."""
    phase = f"worker {w.worker_id} {w.phase.name.lower()}"
    if w.phase is not WorkerPhase.STARTING:
        return phase
    step = f" at {w.step}" if w.step else ""
    return f"{phase} for {now - w.started_at:.0f} s{step}"
