"""gpu_worker.histogram: fixed buckets, the stats message's StageHistogram, quantiles read back from it."""

from __future__ import annotations

import threading

import msgspec

from shmbroker.broker.common import protocol as P
from shmbroker.gpu_worker.histogram import BOUNDS_US, Histogram, mean, quantile


def test_buckets_are_increasing_and_cover_10us_to_10s() -> None:
    assert list(BOUNDS_US) == sorted(set(BOUNDS_US))
    assert (BOUNDS_US[0], BOUNDS_US[-1]) == (10.0, 1e7)


def test_counts_land_in_the_bucket_whose_upper_bound_holds_them() -> None:
    h = Histogram((10.0, 100.0))
    for us in (5, 10, 11, 100, 101, 5000):
        h.add(us)
    snap = h.snapshot()
    assert snap.counts == [2, 2, 2]
    assert (snap.count, snap.sum_us, snap.max_us) == (6, 5227.0, 5000.0)
    h.add_same(50.0, 4)
    assert h.snapshot().counts == [2, 6, 2]
    h.add_all([1.0, 200.0, 99.0])
    h.add_all([])
    snap = h.snapshot()
    assert snap.counts == [3, 7, 3] and snap.count == 13 and snap.sum_us == 5227.0 + 200.0 + 300.0


def test_quantile_and_mean_from_a_snapshot() -> None:
    h = Histogram()
    for _ in range(98):
        h.add(120.0)  # the (100, 125] bucket
    h.add(4200.0)
    h.add(4100.0)  # both in the (4000, 5000] bucket
    snap = h.snapshot()
    assert quantile(snap, 0.5) == 125.0
    assert quantile(snap, 0.99) == 4200.0  # a bucket's bound, capped by the largest value seen
    assert mean(snap) == (98 * 120 + 8300) / 100
    empty = Histogram().snapshot()
    assert quantile(empty, 0.5) is None and mean(empty) is None


def test_concurrent_adds_are_all_counted() -> None:
    h = Histogram()
    def feed() -> None:
        for i in range(2000):
            h.add(float(i))

    threads = [threading.Thread(target=feed) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert h.snapshot().count == 8000


def test_model_stats_carry_stages_and_old_messages_still_decode() -> None:
    snap = Histogram().snapshot()
    stats = P.ModelStats("m", {}, 0, {}, 0, stages={"h2d": snap})
    assert msgspec.json.decode(msgspec.json.encode(stats), type=P.ModelStats) == stats
    old = b'{"name":"m","requests":{},"batches":0,"batch_items":{},"queue_depth":0}'
    assert msgspec.json.decode(old, type=P.ModelStats).stages == {}
