"""broker.common.spin: a loop spins after its work only while most events come back within the window."""

from __future__ import annotations

from shmbroker.broker.common.spin import SpinPolicy

US = 1000


def test_spins_after_an_inline_batch_while_requests_come_quickly() -> None:
    p = SpinPolicy(1000 * US)
    now = 0
    for _ in range(20):
        p.waiting(now)
        assert p.until == now + 1000 * US
        now += 200 * US  # the next request arrives 200 us later, inside the window
        p.arrived(now)


def test_sparse_traffic_stops_the_spin_and_quick_traffic_brings_it_back() -> None:
    p = SpinPolicy(1000 * US)
    now = 0
    for _ in range(20):  # a request every 50 ms: spinning would only burn a core
        p.waiting(now)
        now += 50_000 * US
        p.arrived(now)
    p.waiting(now)
    assert p.until == 0
    spins = []
    for _ in range(30):  # back to back again: the share of quick events passes one half within a few requests
        now += 100 * US
        p.arrived(now)
        p.waiting(now)
        spins.append(p.until != 0)
    assert spins[-1] and spins.index(True) <= 15


def test_a_few_long_pauses_among_quick_events_keep_the_spin() -> None:
    """A preempted machine: one gap in four is 5 ms, the others 200 us. The mean gap (1.4 ms) is past the
    window, but three events in four still come within it, and each would cost a wake-up."""
    p = SpinPolicy(1000 * US)
    now = 0
    for i in range(40):
        p.waiting(now)
        assert p.until == now + 1000 * US, f"no spin after event {i}"
        now += 5000 * US if i % 4 == 3 else 200 * US
        p.arrived(now)


def test_mostly_slow_events_stop_the_spin() -> None:
    """Two gaps in three past the window (a slow model with the odd quick answer): no spin."""
    p = SpinPolicy(1000 * US)
    now = 0
    for i in range(40):
        p.waiting(now)
        now += 200 * US if i % 3 == 0 else 3000 * US
        p.arrived(now)
    p.waiting(now)
    assert p.until == 0


def test_a_reach_of_several_windows_spins_for_events_past_one_window() -> None:
    """Events 2 ms apart: past a 1 ms window, within a reach of four windows (the client's IO thread)."""
    one, four = SpinPolicy(1000 * US), SpinPolicy(1000 * US, reach=4)
    now = 0
    for _ in range(20):
        for p in (one, four):
            p.waiting(now)
        now += 2000 * US
        for p in (one, four):
            p.arrived(now)
    one.waiting(now)
    four.waiting(now)
    assert one.until == 0
    assert four.until == now + 1000 * US  # it still spins one window, not four


def test_zero_never_spins() -> None:
    p = SpinPolicy(0)
    p.waiting(5)
    p.arrived(10)
    p.waiting(10)
    assert p.until == 0


def test_near_events_only_ignore_the_reach() -> None:
    """Bursts 2 ms apart while many requests are in flight (``far=False``): past one window, so no spin
    even with a reach of four windows; the same gaps counted with the reach keep it."""
    near, far = SpinPolicy(1000 * US, reach=4), SpinPolicy(1000 * US, reach=4)
    now = 0
    for _ in range(20):
        for p in (near, far):
            p.waiting(now)
        now += 2000 * US
        near.arrived(now, far=False)
        far.arrived(now)
    near.waiting(now)
    far.waiting(now)
    assert near.until == 0
    assert far.until == now + 1000 * US
