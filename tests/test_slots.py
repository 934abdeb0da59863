"""client.slots: a slot is handed out once until released; a caller that finds none waits within its timeout and
is told why it got none (closed client, a callback that cannot wait, the timeout, naming the slots in flight)."""

from __future__ import annotations

import threading

import pytest

from shmbroker.client import ClientClosed, Overloaded, RequestTimeout
from shmbroker.client.slots import Slots


def _no() -> bool:
    return False


def _yes() -> bool:
    return True


def test_every_slot_is_handed_out_once_until_it_is_released() -> None:
    slots = Slots(3)
    taken = {slots.acquire(None, _no) for _ in range(3)}
    assert taken == {0, 1, 2}
    slots.release(1)
    assert slots.acquire(None, _no) == 1


def test_a_caller_with_none_free_waits_for_a_release() -> None:
    slots = Slots(1)
    first = slots.acquire(None, _no)
    got: list[int] = []
    waiter = threading.Thread(target=lambda: got.append(slots.acquire(20.0, _no)))
    waiter.start()
    slots.release(first)
    waiter.join(20)
    assert got == [first]


def test_none_free_within_the_timeout_says_how_many_are_in_flight() -> None:
    slots = Slots(2)
    slots.acquire(None, _no)
    slots.acquire(None, _no)
    with pytest.raises(RequestTimeout, match=r"no free slot within 0.01 s \(all 2 slots in flight: raise "
                                             r"Client\(slots=\.\.\.\), or the timeout\)"):
        slots.acquire(0.01, _no)


def test_a_callback_is_told_overloaded_naming_the_setting() -> None:
    slots = Slots(1)
    slots.acquire(None, _no)
    with pytest.raises(Overloaded, match=r"raise Client\(slots=...\)"):
        slots.acquire(None, _yes)


def test_a_closed_table_hands_out_nothing_and_wakes_its_waiters() -> None:
    slots = Slots(1)
    slots.acquire(None, _no)
    errors: list[Exception] = []

    def wait() -> None:
        try:
            slots.acquire(None, _no)
        except ClientClosed as exc:
            errors.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    slots.open = False
    slots.wake_all()
    waiter.join(20)
    assert not waiter.is_alive() and len(errors) == 1
    slots.release(0)
    with pytest.raises(ClientClosed):
        slots.acquire(None, _no)
