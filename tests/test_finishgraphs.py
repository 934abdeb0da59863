"""gpu_worker/finishgraphs.py's row buckets (the graphs themselves: tests/gpu/test_finishgraphs.py)."""

from __future__ import annotations

from shmbroker.gpu_worker.finishgraphs import buckets


def test_buckets_are_powers_of_two_then_the_rows() -> None:
    assert buckets(1) == [1]
    assert buckets(12) == [1, 2, 4, 8, 12]
    assert buckets(16) == [1, 2, 4, 8, 16]
