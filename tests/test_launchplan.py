"""gpu_worker.launchplan: when the device is expected to run out of launched work, and the hold it gives."""

from __future__ import annotations

import pytest

from shmbroker.gpu_worker.launchplan import NONE, LaunchPlan

MS = 1e-3


def _plan(margin_ms: float = 1.0) -> LaunchPlan:
    # a batch of n rows computes in n ms; a max batch is 100 rows
    return LaunchPlan(100, lambda rows: rows * MS, margin_s=margin_ms * MS)


def test_no_hold_before_a_lead_was_measured() -> None:
    plan = _plan()
    expected, hold = plan.launched(10.0, 100)
    assert expected == pytest.approx(100 * MS)
    assert hold == NONE


def test_hold_is_the_end_of_launched_work_less_the_lead_of_the_batch_rows() -> None:
    plan = _plan()
    expected, _ = plan.launched(0.0, 100)
    # it ended at 0.1 s; issue plus H2D took 20 ms for its 100 rows; another batch still runs
    plan.ended(0.1, expected, 20 * MS, 100, running=1)
    _, hold = plan.launched(0.1, 100)  # copies in till 0.12 s, computes 0.12 .. 0.22 s
    assert hold.for_rows(100) == pytest.approx(0.22 - 20 * MS - 1 * MS)
    # a batch of 10 rows copies in within 2 ms: it may grow until 2 ms before the device runs out of work
    assert hold.for_rows(10) == pytest.approx(0.22 - 2 * MS - 1 * MS)


def test_launches_queue_behind_each_other() -> None:
    plan = _plan(margin_ms=0.0)
    e, _ = plan.launched(0.0, 10)
    plan.ended(0.01, e, 10 * MS, 10, running=1)  # lead 1 ms a row: 100 ms for a max batch
    plan.launched(1.0, 100)  # copies in till 1.1, computes 1.1 .. 1.2
    _, hold = plan.launched(1.0, 100)  # after it: 1.2 .. 1.3
    assert hold.for_rows(100) == pytest.approx(1.3 - 0.1)


def test_an_early_end_moves_the_hold_earlier_and_the_last_end_clears_it() -> None:
    plan = _plan(margin_ms=0.0)
    e0, _ = plan.launched(0.0, 10)
    plan.ended(0.01, e0, 1 * MS, 10, running=0)  # lead 0.1 ms a row: 10 ms for a max batch
    a, _ = plan.launched(1.0, 100)  # copied by 1.01, planned 1.01 .. 1.11
    b, hold = plan.launched(1.0, 100)  # planned 1.11 .. 1.21
    assert hold.for_rows(100) == pytest.approx(1.21 - 0.01)
    hold = plan.ended(1.05, a, 10 * MS, 100, running=1)  # ended 50 ms early: b ends 100 ms from now
    assert hold.for_rows(100) == pytest.approx(1.15 - 0.01)
    assert plan.ended(1.15, b, 10 * MS, 100, running=0) == NONE  # nothing runs: nothing to wait for


def test_a_failed_batch_gives_no_lead_sample() -> None:
    plan = _plan(margin_ms=0.0)
    e, _ = plan.launched(0.0, 100)
    plan.ended(0.1, e, 10 * MS, 100, running=0)
    assert plan.lead_per_row_s == pytest.approx(0.1 * MS)
    e, _ = plan.launched(1.0, 100)
    plan.ended(1.1, e, None, 100, running=0)
    assert plan.lead_per_row_s == pytest.approx(0.1 * MS)


def test_a_primed_lead_holds_before_any_batch_ended_and_lead_rows_fix_it() -> None:
    plan = LaunchPlan(100, lambda rows: rows * MS, margin_s=0.0, lead_rows=10)
    plan.prime(1 * MS)  # 1 ms a row: the lead of 10 rows is 10 ms
    _, hold = plan.launched(0.0, 100)  # its last 10 rows copy in till 0.01, it computes till 0.11
    assert hold.for_rows(100) == hold.for_rows(1) == pytest.approx(0.11 - 0.01)  # rows copied as they came
    plan.prime(5 * MS)  # a measured lead is not replaced
    _, hold = plan.launched(0.0, 100)
    assert hold.for_rows(100) == pytest.approx(0.21 - 0.01)



def test_a_batch_launched_on_an_idle_device_computes_after_its_copies() -> None:
    """The slow mode's cause: counted from its issue, the end of a batch launched while the device waited came
    a copy-in too soon, and the next batch left early with few rows."""
    plan = _plan(margin_ms=0.0)
    e, _ = plan.launched(0.0, 100)
    plan.ended(0.1, e, 50 * MS, 100, running=0)  # lead 0.5 ms a row
    _, hold = plan.launched(1.0, 100)  # the device is idle: copies till 1.05, computes till 1.15
    assert hold.for_rows(100) == pytest.approx(1.15 - 50 * MS)
    assert hold.for_rows(20) == pytest.approx(1.15 - 10 * MS)
