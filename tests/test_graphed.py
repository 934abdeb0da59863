"""The CUDA graph sizes of a model that runs any batch (no GPU needed: a pure function)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from shmbroker.gpu_worker.engines.graphed import graph_ladder


@given(st.integers(min_value=1, max_value=4096))
def test_every_batch_pads_at_most_a_quarter_and_max_batch_has_its_own_graph(max_batch: int) -> None:
    sizes = graph_ladder(max_batch)
    assert sizes == sorted(set(sizes))
    assert sizes[0] == 1 and sizes[-1] == max_batch
    for rows in range(1, max_batch + 1):
        runs_in = min(s for s in sizes if s >= rows)
        assert runs_in == rows or runs_in <= rows * 1.25, (rows, runs_in)


def test_a_256_row_model_captures_28_sizes_not_256() -> None:
    assert graph_ladder(256) == [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 56, 64, 80, 96, 112,
                                 128, 160, 192, 224, 256]
