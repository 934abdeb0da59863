"""The supervisor's start deadline and what health says of a starting worker (no process: a stand-in launch)."""

from __future__ import annotations

from pathlib import Path

from shmbroker.broker.common.config import Config, parse
from shmbroker.broker.serving.health import health_reply
from shmbroker.broker.serving.supervisor import Supervisor, WorkerPhase, WorkerSlot

TIMEOUT_S = 30.0


class StandIn:
    """A worker that is alive until the supervisor kills it (supervisor.Launch)."""

    def __init__(self, cfg: Config, worker_id: int, runtime_dir: Path, restarts: int) -> None:
        self.killed = False

    @property
    def pid(self) -> int:
        return 4242

    def wait(self, timeout: float) -> bool:
        return self.killed

    def alive(self) -> bool:
        return not self.killed

    def stop(self, kill: bool = False) -> None:
        self.killed = kill


def _starting(tmp_path: Path, started_at: float) -> tuple[Supervisor, WorkerSlot, StandIn]:
    cfg = parse({"broker": {"worker_start_timeout_ms": int(TIMEOUT_S * 1000)},
                 "models": {"tiny": {"path": "builtin:tiny", "max_batch": 4}}})
    sup = Supervisor(cfg, tmp_path)
    w, launch = sup.workers[0], StandIn(cfg, 0, tmp_path, 0)
    w.launch, w.started_at, w.step_at = launch, started_at, started_at  # as _start leaves it
    return sup, w, launch


def test_a_start_that_reports_steps_may_take_longer_than_the_timeout(tmp_path: Path) -> None:
    sup, w, launch = _starting(tmp_path, started_at=1000.0)
    for k in range(1, 10):  # a step every 20 s: 180 s in all, six times the timeout
        sup.progress(w, f"step {k}", 1000.0 + 20 * k)
        sup.check(1000.0 + 20 * k + 19)
    assert not launch.killed and w.phase is WorkerPhase.STARTING and w.step == "step 9"


def test_a_start_with_no_progress_for_the_timeout_is_killed_naming_its_step_and_the_setting(tmp_path: Path) -> None:
    sup, w, launch = _starting(tmp_path, started_at=1000.0)
    sup.progress(w, "model m (1 of 1): warming up its engine at 1 and 4 rows", 1050.0)
    sup.check(1050.0 + TIMEOUT_S - 1)
    assert not launch.killed
    sup.check(1050.0 + TIMEOUT_S + 1)
    assert launch.killed
    assert w.reason == ("not ready after 81 s, 30 s of them with no progress at 'model m (1 of 1): warming up its "
                        "engine at 1 and 4 rows' (raise broker.worker_start_timeout_ms)"), w.reason


def test_a_worker_that_never_reports_a_step_is_killed_after_the_timeout(tmp_path: Path) -> None:
    sup, w, launch = _starting(tmp_path, started_at=1000.0)
    sup.check(1000.0 + TIMEOUT_S + 1)
    assert launch.killed
    assert w.reason == "not ready after 31 s, 30 s of them with no progress (raise broker.worker_start_timeout_ms)"


def test_health_names_a_starting_workers_step(tmp_path: Path) -> None:
    sup, w, _ = _starting(tmp_path, started_at=0.0)  # time.monotonic() is far past 0: the start took that long
    sup.progress(w, "model tiny (1 of 1): loading its onnxruntime engine", 0.0)
    reply = health_reply(sup.cfg, sup)
    assert not reply.ready
    assert reply.reason.startswith("models not ready: tiny (worker 0 starting for "), reply.reason
    assert reply.reason.endswith(" s at model tiny (1 of 1): loading its onnxruntime engine)"), reply.reason


def test_steps_after_the_start_are_ignored(tmp_path: Path) -> None:
    sup, w, _ = _starting(tmp_path, started_at=1000.0)
    w.phase = WorkerPhase.READY
    sup.progress(w, "late", 2000.0)
    assert (w.step, w.step_at) == ("", 1000.0)
