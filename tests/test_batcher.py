"""gpu_worker.batcher: when a batch forms, what it holds, and what never gets into one.

Timing: only lower bounds on elapsed time are asserted (monotonic time cannot run short); "not yet" checks
use delays far longer than the short waits that observe them.
"""

from __future__ import annotations

import threading
import time

import pytest

from shmbroker.gpu_worker.batcher import Batcher, More, Queued, Take
from shmbroker.gpu_worker.batching import BatchPolicy

LONG = 60.0  # seconds: a delay or deadline that no test waits for
LONG_US = int(LONG * 1e6)


def _entry(name: str, items: int = 1, deadline_in: float = LONG, enqueued: float | None = None) -> Queued[str]:
    now = time.monotonic()
    if enqueued is None:
        return Queued(name, items, now + deadline_in)
    return Queued(name, items, now + deadline_in, enqueued)


def _names(entries: list[Queued[str]]) -> list[str]:
    return [e.item for e in entries]


def _batcher(
    max_batch: int = 4, delay_us: int = LONG_US, preferred: list[int] | None = None, size: int = 100
) -> Batcher[Queued[str]]:
    return Batcher(BatchPolicy(max_batch, delay_us, tuple(preferred or ()), size, "triton"))


def _take_in_thread(b: Batcher[Queued[str]],
                    timeout: float | None) -> tuple[threading.Thread, list[Take[Queued[str]] | None]]:
    out: list[Take[Queued[str]] | None] = []
    t = threading.Thread(target=lambda: out.append(b.take(timeout)), daemon=True)
    t.start()
    return t, out


def _wait_until_sleeping(b: Batcher[Queued[str]], n: int = 1) -> None:
    """Return once ``n`` threads wait on the batcher's condition (a readiness check, not a sleep)."""
    end = time.monotonic() + 30.0
    while len(b._cond._waiters) < n:  # type: ignore[attr-defined]
        assert time.monotonic() < end, "the taker never went to sleep"  # spins; the GIL switches threads


# ---------------------------------------------------------------------------------------------------------
# When a batch forms
# ---------------------------------------------------------------------------------------------------------
def test_full_max_batch_forms_at_once() -> None:
    b = _batcher(max_batch=4)
    for i in range(3):
        assert b.put(_entry(f"r{i}"))
    assert b.take_now() is None  # 3 of 4, the delay is a minute away
    assert b.put(_entry("r3"))
    take = b.take_now()
    assert take is not None
    assert _names(take.batch) == ["r0", "r1", "r2", "r3"]
    assert take.expired == []
    assert len(b) == 0


def test_full_batch_through_take_does_not_wait_for_the_delay() -> None:
    b = _batcher(max_batch=2)
    b.put(_entry("a"))
    b.put(_entry("b"))
    take = b.take(timeout=30.0)  # the delay is 60 s: only the full batch rule can answer this
    assert take is not None
    assert _names(take.batch) == ["a", "b"]


def test_batch_takes_at_most_max_batch() -> None:
    b = _batcher(max_batch=3)
    for i in range(7):
        b.put(_entry(f"r{i}"))
    first, second = b.take_now(), b.take_now()
    assert first is not None
    assert second is not None
    assert _names(first.batch) == ["r0", "r1", "r2"]
    assert _names(second.batch) == ["r3", "r4", "r5"]
    assert b.take_now() is None  # one left, not due
    assert len(b) == 1


def test_preferred_size_forms_at_once() -> None:
    b = _batcher(max_batch=16, preferred=[4, 2])
    b.put(_entry("a"))
    assert b.take_now() is None
    b.put(_entry("b"))
    take = b.take_now()
    assert take is not None
    assert _names(take.batch) == ["a", "b"]


def test_largest_reached_preferred_size_is_taken() -> None:
    b = _batcher(max_batch=16, preferred=[2, 4, 8])
    for i in range(6):
        b.put(_entry(f"r{i}"), wake=False)
    take = b.take_now()
    assert take is not None
    assert _names(take.batch) == ["r0", "r1", "r2", "r3"]  # 4 of 6: the largest preferred size reached
    take = b.take_now()
    assert take is not None
    assert _names(take.batch) == ["r4", "r5"]


def test_below_every_threshold_waits_for_the_delay() -> None:
    delay = 0.5
    b = _batcher(max_batch=8, delay_us=int(delay * 1e6), preferred=[4])
    entry = _entry("only")
    b.put(entry)
    assert b.take_now() is None
    assert b.take(timeout=0.01) is None  # well before the delay
    take = b.take(timeout=30.0)
    assert take is not None
    assert _names(take.batch) == ["only"]
    assert time.monotonic() - entry.enqueued >= delay


def test_the_delay_counts_from_the_oldest_request() -> None:
    b = _batcher(max_batch=8, delay_us=1_000_000)
    b.put(_entry("old", enqueued=time.monotonic() - 5.0))  # waited long past the 1 s delay
    b.put(_entry("new"))
    take = b.take_now()
    assert take is not None
    assert _names(take.batch) == ["old", "new"]


def test_zero_delay_batches_whatever_is_there() -> None:
    b = _batcher(max_batch=8, delay_us=0)
    b.put(_entry("a"))
    take = b.take_now()
    assert take is not None
    assert _names(take.batch) == ["a"]


def test_a_sleeping_take_is_woken_by_put() -> None:
    b = _batcher(max_batch=2)
    t, out = _take_in_thread(b, timeout=30.0)
    _wait_until_sleeping(b)  # asleep on an empty queue: only put's notify can end the wait early
    b.put(_entry("a"))
    b.put(_entry("b"))
    t.join(20.0)  # well before the taker's own 30 s timeout
    assert not t.is_alive()
    assert out[0] is not None
    assert _names(out[0].batch) == ["a", "b"]


def test_two_batches_due_at_once_wake_two_sleeping_takers() -> None:
    b = _batcher(max_batch=2)
    (t1, out1), (t2, out2) = _take_in_thread(b, timeout=30.0), _take_in_thread(b, timeout=30.0)
    _wait_until_sleeping(b, 2)  # both asleep on an empty queue (a CPU model's instances' runner threads)
    b.put_many([_entry(n) for n in "abcd"], wake=True)  # one notify for two due batches
    t1.join(20.0)
    t2.join(20.0)  # well before their own 30 s timeouts: the first taker woke the second
    assert not t1.is_alive() and not t2.is_alive()
    taken = sorted(_names(o[0].batch) for o in (out1, out2) if o[0] is not None)
    assert taken == [["a", "b"], ["c", "d"]]


def test_put_without_wake_leaves_the_runner_asleep_until_kick() -> None:
    b = _batcher(max_batch=1)
    t, out = _take_in_thread(b, timeout=30.0)
    _wait_until_sleeping(b)
    b.put(_entry("a"), wake=False)
    t.join(0.2)
    assert t.is_alive()  # nobody told it (it could only return on its own after 30 s)
    b.kick()
    t.join(20.0)
    assert not t.is_alive()
    assert out[0] is not None
    assert _names(out[0].batch) == ["a"]


def test_kick_on_an_empty_queue_does_not_end_a_take() -> None:
    b = _batcher(max_batch=1)
    t, out = _take_in_thread(b, timeout=30.0)
    _wait_until_sleeping(b)
    b.kick()
    t.join(0.2)
    assert t.is_alive()
    b.put(_entry("a"))
    t.join(20.0)
    assert out[0] is not None
    assert _names(out[0].batch) == ["a"]


# ---------------------------------------------------------------------------------------------------------
# Expiry
# ---------------------------------------------------------------------------------------------------------
def test_expired_entries_are_never_batched() -> None:
    b = _batcher(max_batch=2)
    b.put(_entry("late", deadline_in=-1.0))
    b.put(_entry("a"))
    b.put(_entry("b"))
    take = b.take_now()
    assert take is not None
    assert _names(take.expired) == ["late"]
    assert _names(take.batch) == ["a", "b"]
    assert len(b) == 0


def test_expired_entries_do_not_count_towards_a_batch() -> None:
    b = _batcher(max_batch=2)
    b.put(_entry("late", deadline_in=-1.0))
    b.put(_entry("a"))
    take = b.take_now()
    assert take is not None
    assert take.batch == []  # "a" alone is not a full batch once "late" is gone
    assert _names(take.expired) == ["late"]
    assert len(b) == 1
    b.put(_entry("b"))
    take = b.take_now()
    assert take is not None
    assert _names(take.batch) == ["a", "b"]
    assert take.expired == []


def test_take_returns_requests_that_expire_while_waiting() -> None:
    b = _batcher(max_batch=8)  # the delay is a minute away; the deadline is not
    entry = _entry("soon", deadline_in=0.05)
    b.put(entry)
    take = b.take(timeout=30.0)
    assert take is not None
    assert take.batch == []
    assert take.expired == [entry]
    assert time.monotonic() >= entry.deadline
    assert len(b) == 0
    assert b.take_now() is None


def test_expire_removes_only_past_deadlines() -> None:
    b = _batcher(max_batch=8)
    now = time.monotonic()
    b.put(Queued("past", 1, now - 1.0))
    b.put(Queued("edge", 2, now))
    b.put(Queued("future", 3, now + LONG))
    assert b.next_deadline() == now - 1.0
    assert _names(b.expire(now)) == ["past", "edge"]
    assert len(b) == 1
    assert b.next_deadline() == now + LONG
    assert b.expire(now) == []
    # the expired rows were subtracted: 3 + 4 rows stay below max_batch 8 (3 + 3 + 4 would not)
    b.put(Queued("more", 4, now + LONG))
    assert b.take_now() is None
    b.put(Queued("last", 1, now + LONG))
    take = b.take_now()
    assert take is not None
    assert _names(take.batch) == ["future", "more", "last"]


def test_next_deadline_of_an_empty_queue() -> None:
    assert _batcher().next_deadline() is None


# ---------------------------------------------------------------------------------------------------------
# Capacity, close
# ---------------------------------------------------------------------------------------------------------
def test_put_refuses_past_max_queue_size() -> None:
    b = _batcher(max_batch=100, size=3)
    assert [b.put(_entry(f"r{i}")) for i in range(3)] == [True, True, True]
    assert b.put(_entry("r3")) is False
    assert len(b) == 3
    b.expire(time.monotonic())  # nothing expires: still full
    assert b.put(_entry("r4")) is False
    b.close()
    assert b.put(_entry("r5")) is False


def test_a_slot_frees_when_a_batch_is_taken() -> None:
    b = _batcher(max_batch=2, size=2)
    b.put(_entry("a"))
    b.put(_entry("b"))
    assert b.put(_entry("c")) is False
    assert b.take_now() is not None
    assert b.put(_entry("c")) is True


def test_queue_size_counts_requests_not_rows() -> None:
    b = _batcher(max_batch=100, size=2)
    assert b.put(_entry("a", items=40))
    assert b.put(_entry("b", items=40))
    assert not b.put(_entry("c", items=1))


def test_close_returns_what_was_queued() -> None:
    b = _batcher(max_batch=8)
    entries = [_entry(f"r{i}", items=i + 1) for i in range(3)]
    for e in entries:
        b.put(e)
    assert b.close() == entries
    assert len(b) == 0
    assert b.take_now() is None
    assert b.take(timeout=0.0) is None
    assert b.take(timeout=None) is None  # closed: returns at once, does not block
    assert b.close() == []


def test_close_wakes_a_sleeping_take() -> None:
    b = _batcher()
    t, out = _take_in_thread(b, timeout=None)  # would block forever on an open, empty batcher
    _wait_until_sleeping(b)
    b.close()
    t.join(30.0)
    assert not t.is_alive()
    assert out == [None]


# ---------------------------------------------------------------------------------------------------------
# Rows
# ---------------------------------------------------------------------------------------------------------
def test_rows_are_counted_not_requests() -> None:
    b = _batcher(max_batch=4)
    b.put(_entry("a", items=2))
    assert b.take_now() is None  # 2 rows of 4
    b.put(_entry("b", items=2))
    take = b.take_now()
    assert take is not None
    assert _names(take.batch) == ["a", "b"]


def test_a_batch_never_exceeds_max_batch_rows() -> None:
    b = _batcher(max_batch=4)
    b.put(_entry("a", items=3))
    b.put(_entry("b", items=2))  # 5 rows queued: due, but b does not fit next to a
    take = b.take_now()
    assert take is not None
    assert _names(take.batch) == ["a"]
    assert b.take_now() is None  # b's 2 rows wait for more or for the delay
    assert len(b) == 1
    b.put(_entry("c", items=2))
    take = b.take_now()
    assert take is not None
    assert _names(take.batch) == ["b", "c"]


def test_preferred_size_in_rows() -> None:
    b = _batcher(max_batch=16, preferred=[4])
    b.put(_entry("a", items=3))
    assert b.take_now() is None
    b.put(_entry("b", items=1))
    take = b.take_now()
    assert take is not None
    assert _names(take.batch) == ["a", "b"]


def test_request_larger_than_a_preferred_size_is_served() -> None:
    b = _batcher(max_batch=8, preferred=[2])
    b.put(_entry("big", items=3))
    take = b.take_now()
    assert take is not None
    assert _names(take.batch) == ["big"]
    assert len(b) == 0


def test_request_larger_than_a_preferred_size_behind_a_small_one() -> None:
    b = _batcher(max_batch=8, preferred=[2])
    b.put(_entry("small", items=1), wake=False)
    b.put(_entry("big", items=3), wake=False)
    served: list[str] = []
    for _ in range(2):
        take = b.take_now()
        assert take is not None
        served += _names(take.batch)
    assert served == ["small", "big"]
    assert len(b) == 0


# ---------------------------------------------------------------------------------------------------------
# take_now / take never block past what they promise
# ---------------------------------------------------------------------------------------------------------
def test_take_now_never_blocks() -> None:
    b = _batcher(max_batch=8)  # a delay of a minute: a blocking take_now would hang the test
    assert b.take_now() is None
    b.put(_entry("a"))
    assert b.take_now() is None
    assert len(b) == 1


def test_take_times_out_on_an_empty_queue() -> None:
    b = _batcher()
    start = time.monotonic()
    assert b.take(timeout=0.05) is None
    assert time.monotonic() - start >= 0.05


@pytest.mark.parametrize("timeout", [0.0, 0.01])
def test_take_with_a_batch_due_ignores_a_short_timeout(timeout: float) -> None:
    b = _batcher(max_batch=1)
    b.put(_entry("a"))
    take = b.take(timeout=timeout)
    assert take is not None
    assert _names(take.batch) == ["a"]


def test_every_request_ends_up_exactly_once() -> None:
    """The invariant: queued, or in one batch, or expired; never two of these."""
    b = _batcher(max_batch=5, delay_us=0, preferred=[3])
    now = time.monotonic()
    entries = [Queued(f"r{i}", 1 + i % 3, now + (-1.0 if i % 4 == 0 else LONG)) for i in range(40)]
    seen: list[str] = []
    for chunk in range(0, 40, 7):
        for e in entries[chunk : chunk + 7]:
            assert b.put(e, wake=False)
        while (take := b.take_now()) is not None:
            assert sum(e.rows for e in take.batch) <= 5 or len(take.batch) == 1
            assert all(e.deadline > now for e in take.batch)
            assert all(e.deadline <= now for e in take.expired)
            seen += _names(take.batch) + _names(take.expired)
    seen += _names(b.close())
    assert sorted(seen) == sorted(e.item for e in entries)
    assert len(seen) == len(set(seen))


# ---------------------------------------------------------------------------------------------------------
# By session: each session's queued requests together
# ---------------------------------------------------------------------------------------------------------
def _by_session(max_batch: int = 4) -> Batcher[Queued[str]]:
    return Batcher(BatchPolicy(max_batch, LONG_US, (), 100, "triton", by_session=True))


def _from(session: str, name: str, items: int = 1) -> Queued[str]:
    return Queued(name, items, time.monotonic() + LONG, session=session)


def test_by_session_a_batch_takes_each_sessions_requests_together() -> None:
    """A1 B1 A2 C1 A3 B2 queued, 4 rows a batch: A's three and B's first, then C's and B's second (by their age);
    in arrival order (the default) A1 B1 A2 C1, then A3 B2."""
    arrivals = [("A", "a1"), ("B", "b1"), ("A", "a2"), ("C", "c1"), ("A", "a3"), ("B", "b2")]
    for grouped, expected in ((True, [["a1", "a2", "a3", "b1"], ["c1", "b2"]]),
                              (False, [["a1", "b1", "a2", "c1"], ["a3", "b2"]])):
        b = _by_session() if grouped else _batcher(max_batch=4)
        for session, name in arrivals:
            b.put(_from(session, name), wake=False)
        first = b.take_now()
        assert first is not None and _names(first.batch) == expected[0]
        assert b.take_now() is None  # 2 rows of 4: they wait for the delay
        b.put(_from("D", "d1"))
        b.put(_from("D", "d2"))
        second = b.take_now()
        assert second is not None and _names(second.batch) == expected[1] + ["d1", "d2"]
        assert len(b) == 0


def test_by_session_stops_at_the_first_request_that_does_not_fit() -> None:
    """A's second request (3 rows) does not fit beside its first (2): the batch is A1 alone, as in arrival
    order; the next takes B1 and A2, by their age, and C1 waits."""
    b = _by_session(max_batch=4)
    b.put(_from("A", "a1", items=2), wake=False)
    b.put(_from("B", "b1", items=1), wake=False)
    b.put(_from("A", "a2", items=3), wake=False)
    take = b.take_now()
    assert take is not None and _names(take.batch) == ["a1"]
    assert len(b) == 2
    b.put(_from("C", "c1", items=1))  # 5 rows queued: B1 and C1 wait behind A2
    take = b.take_now()
    assert take is not None and _names(take.batch) == ["b1", "a2"]


def test_by_session_keeps_the_expired_out_and_the_rest_in_order() -> None:
    b = _by_session(max_batch=2)
    b.put(Queued("gone", 1, time.monotonic() - 1.0, session="A"), wake=False)
    for session, name in (("B", "b1"), ("A", "a1"), ("B", "b2")):
        b.put(_from(session, name), wake=False)
    take = b.take_now()
    assert take is not None and _names(take.expired) == ["gone"] and _names(take.batch) == ["b1", "b2"]
    assert [e.item for e in b.close()] == ["a1"]


# ---------------------------------------------------------------------------------------------------------
# Idle dispatch: no delay while an executor would sit idle
# ---------------------------------------------------------------------------------------------------------
def test_idle_dispatch_sends_a_lone_request_at_once_and_waits_while_busy() -> None:
    b: Batcher[Queued[str]] = Batcher(BatchPolicy(4, LONG_US, (), 100, "idle", executors=1))
    assert b.put(_entry("lone"))
    first = b.take_now()  # nothing runs: due now although the delay is a minute away
    assert first is not None and _names(first.batch) == ["lone"]
    assert b.running == 1
    assert b.put(_entry("second"))
    assert b.take_now() is None  # one batch runs, the only executor is busy: the delay applies again
    t, out = _take_in_thread(b, LONG)
    _wait_until_sleeping(b)
    b.done()  # the executor is free: the waiting taker gets the queued request without the delay
    t.join(LONG)
    assert out and out[0] is not None and _names(out[0].batch) == ["second"]
    b.done()
    assert b.running == 0


def test_idle_dispatch_fills_every_instance_then_waits() -> None:
    b: Batcher[Queued[str]] = Batcher(BatchPolicy(4, LONG_US, (), 100, "idle", executors=2))
    for name in ("a", "b"):
        assert b.put(_entry(name))
    first = b.take_now()
    assert first is not None and _names(first.batch) == ["a", "b"]  # all there was, at once
    assert b.put(_entry("c"))
    second = b.take_now()
    assert second is not None and _names(second.batch) == ["c"]  # the second instance is idle: no delay
    assert b.put(_entry("d"))
    assert b.take_now() is None  # both instances busy: by the delay
    b.done()
    third = b.take_now()
    assert third is not None and _names(third.batch) == ["d"]


def test_without_idle_dispatch_a_lone_request_waits_for_the_delay() -> None:
    b = _batcher(max_batch=4)  # Triton's rule
    assert b.put(_entry("lone"))
    assert b.take_now() is None


# ---------------------------------------------------------------------------------------------------------
# Hold: while the device is busy, a batch that is not full grows until the device needs it
# ---------------------------------------------------------------------------------------------------------
def test_a_hold_keeps_a_busy_batch_growing_past_the_delay() -> None:
    b: Batcher[Queued[str]] = Batcher(BatchPolicy(4, 0, (), 100, "idle", executors=1))  # no delay at all
    b.put(_entry("running"))
    assert b.take_now() is not None  # the device now runs a batch
    b.hold(time.monotonic() + LONG)  # ... that keeps it busy for a minute
    b.put(_entry("a"))
    assert b.take_now() is None  # the delay has passed, the hold has not
    for name in ("b", "c", "d"):
        b.put(_entry(name))
    full = b.take_now()  # a full batch leaves whatever the hold
    assert full is not None and _names(full.batch) == ["a", "b", "c", "d"]


def test_a_per_row_hold_lets_few_rows_wait_and_many_leave() -> None:
    """A slot freed just after its answers must not take the few rows queued before those clients' next
    requests come: the rows of a batch take time to copy in, so few rows may wait longer than many."""
    b: Batcher[Queued[str]] = Batcher(BatchPolicy(8, 0, (), 100, "idle", executors=1))
    b.put(_entry("running"))
    assert b.take_now() is not None  # the device now runs a batch ...
    # ... for another minute; each row takes 10 s to copy in
    b.hold(time.monotonic() + LONG, per_row_s=LONG / 6)
    b.put(_entry("a"))
    assert b.take_now() is None  # one row copies in within 10 s: it may wait
    for name in "bcdef":
        b.put(_entry(name))
    take = b.take_now()  # six rows take the whole minute to copy in: they leave now
    assert take is not None and _names(take.batch) == list("abcdef")


def test_more_rows_wake_a_taker_held_for_few() -> None:
    b: Batcher[Queued[str]] = Batcher(BatchPolicy(8, 0, (), 100, "idle", executors=1))
    b.put(_entry("running"))
    assert b.take_now() is not None
    b.hold(time.monotonic() + LONG, per_row_s=LONG / 6)
    b.put(_entry("a"))
    t, out = _take_in_thread(b, LONG)
    _wait_until_sleeping(b)
    t.join(0.2)
    assert t.is_alive()  # held for 50 s
    for name in "bcdef":
        b.put(_entry(name))
    t.join(LONG)
    assert out and out[0] is not None and _names(out[0].batch) == list("abcdef")


def test_a_hold_in_the_past_leaves_the_delay_rule() -> None:
    b: Batcher[Queued[str]] = Batcher(BatchPolicy(4, 0, (), 100, "idle", executors=1))
    b.put(_entry("running"))
    assert b.take_now() is not None
    b.hold(time.monotonic() - 1.0)
    b.put(_entry("a"))
    take = b.take_now()
    assert take is not None and _names(take.batch) == ["a"]


def test_a_hold_does_not_apply_while_the_device_is_idle() -> None:
    b: Batcher[Queued[str]] = Batcher(BatchPolicy(4, 0, (), 100, "idle", executors=1))
    b.hold(time.monotonic() + LONG)
    b.put(_entry("lone"))
    take = b.take_now()  # nothing runs: idle dispatch
    assert take is not None and _names(take.batch) == ["lone"]


def test_moving_a_hold_earlier_wakes_the_waiting_taker() -> None:
    b: Batcher[Queued[str]] = Batcher(BatchPolicy(4, 0, (), 100, "idle", executors=1))
    b.put(_entry("running"))
    assert b.take_now() is not None
    b.hold(time.monotonic() + LONG)
    b.put(_entry("a"))
    t, out = _take_in_thread(b, LONG)
    _wait_until_sleeping(b)
    t.join(0.2)
    assert t.is_alive()  # held for a minute
    b.hold(0.0)  # the device ends sooner than planned
    t.join(LONG)
    assert out and out[0] is not None and _names(out[0].batch) == ["a"]


def test_a_new_entry_with_the_soonest_deadline_wakes_the_taker() -> None:
    b = _batcher(max_batch=4)  # a minute's delay
    b.put(_entry("a"))
    t, out = _take_in_thread(b, LONG)
    _wait_until_sleeping(b)
    b.put(_entry("b"))  # due no sooner
    t.join(0.2)
    assert t.is_alive()
    b.put(_entry("c", deadline_in=0.05))  # its deadline comes before the delay: the taker must see it expire
    t.join(20.0)  # well before the minute's delay
    assert not t.is_alive()
    assert out and out[0] is not None and _names(out[0].expired) == ["c"] and out[0].batch == []


def test_while_a_batch_runs_one_that_is_not_full_takes_the_largest_size_that_needs_no_padding() -> None:
    b: Batcher[Queued[str]] = Batcher(BatchPolicy(8, 0, (), 100, "idle", executors=1))
    b.device_ready([1, 2, 4, 8])
    for name in "abcdef":
        b.put(_entry(name))
    idle = b.take_now()  # nothing runs: all six leave at once, padded to 8 by the engine
    assert idle is not None and _names(idle.batch) == list("abcdef")
    for name in "ghijkl":
        b.put(_entry(name))
    busy = b.take_now()  # one batch runs: four leave, two wait for the next batch
    assert busy is not None and _names(busy.batch) == list("ghij")
    assert len(b) == 2


def test_the_prepared_sizes_apply_only_as_the_policy_says() -> None:
    b: Batcher[Queued[str]] = Batcher(BatchPolicy(8, 0, (), 100, "idle", executors=1, trim_to_sizes=False))
    b.device_ready([1, 2, 4, 8])
    b.put(_entry("running"))
    assert b.take_now() is not None
    for name in "abcdef":
        b.put(_entry(name))
    busy = b.take_now()  # not trimmed to a prepared size: all six
    assert busy is not None and _names(busy.batch) == list("abcdef")


# ---------------------------------------------------------------------------------------------------------
# take_more: a batch that fills on the device, its rows copied as they come
# ---------------------------------------------------------------------------------------------------------
def _take_more_asleep(b: Batcher[Queued[str]], room: int,
                      chunk: int) -> tuple[threading.Thread, list[More[Queued[str]]]]:
    """``take_more`` on a thread of its own, returned once that thread sleeps in it."""
    out: list[More[Queued[str]]] = []
    t = threading.Thread(target=lambda: out.append(b.take_more(room, chunk, LONG)), daemon=True)
    t.start()
    _wait_until_sleeping(b)
    return t, out


def _filling(hold_in: float = LONG) -> Batcher[Queued[str]]:
    """A batcher whose device runs one batch and holds another (the filling one) for ``hold_in`` seconds."""
    b: Batcher[Queued[str]] = Batcher(BatchPolicy(8, 0, (), 100, "idle", executors=1, early_copies=True))
    for name in ("running", "filling"):
        b.put(_entry(name))
        assert b.take_now() is not None
    b.hold(time.monotonic() + hold_in)
    return b


def test_take_more_hands_a_chunk_once_it_waits_and_keeps_the_batch_open() -> None:
    b = _filling()
    for name in "abc":
        b.put(_entry(name))
    more = b.take_more(room=7, chunk=2, timeout=LONG)
    assert _names(more.batch) == ["a", "b", "c"] and not more.close
    assert b.running == 2  # the same batch: nothing more runs


def test_take_more_takes_at_most_the_room_left() -> None:
    b = _filling()
    for name in "abcd":
        b.put(_entry(name))
    more = b.take_more(room=3, chunk=2, timeout=LONG)
    assert _names(more.batch) == ["a", "b", "c"]
    assert len(b) == 1


def test_a_sleeping_take_more_wakes_for_its_chunk() -> None:
    b = _filling()
    t, out = _take_more_asleep(b, 7, 2)
    b.put(_entry("a"))
    t.join(0.2)
    assert t.is_alive()  # one row of a chunk of two
    b.put(_entry("b"))
    t.join(20.0)
    assert not t.is_alive()
    assert _names(out[0].batch) == ["a", "b"]


def test_take_more_closes_when_the_other_batch_ends() -> None:
    b = _filling()
    t, out = _take_more_asleep(b, 7, 4)
    b.put(_entry("a"))
    b.done()  # the running batch ended: the filling one must launch now, with what it has
    t.join(20.0)
    assert not t.is_alive()
    more = out[0]
    assert more.close and _names(more.batch) == ["a"]


def test_take_more_closes_at_the_hold() -> None:
    b = _filling(hold_in=LONG)
    t, out = _take_more_asleep(b, 7, 4)
    b.hold(time.monotonic() - 1.0)  # the device will need it now
    t.join(20.0)
    assert not t.is_alive() and out[0].close


def test_early_opening_ignores_the_hold() -> None:
    b = _filling()
    b.put(_entry("a"))
    opened = b.take_now()  # zero delay: a batch opens to copy its rows early, whatever the hold
    assert opened is not None and _names(opened.batch) == ["a"]


def test_take_more_closes_when_the_next_request_does_not_fit() -> None:
    b = _filling()
    b.put(_entry("a"))
    b.put(_entry("big", items=4))
    more = b.take_more(room=3, chunk=2, timeout=LONG)  # "a" fits, "big" never will: launch with what there is
    assert _names(more.batch) == ["a"] and more.close
    assert len(b) == 1
