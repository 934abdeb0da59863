"""bench.gpu_load: the worker's figures of a window are the difference of two stats snapshots."""

from __future__ import annotations

from shmbroker.bench import gpu_load
from shmbroker.broker.common import protocol as P


def _reply(batch_items: dict[str, int], compute_us: float) -> P.StatsReply:
    batches = sum(batch_items.values())
    compute = P.StageHistogram([1000.0], [batches, 0], batches, compute_us, 900.0)
    model = P.ModelStats("nsfw", {"OK": 0}, batches, batch_items, 0, {"compute": compute})
    return P.StatsReply([P.WorkerStats(0, 1, 0, [model])])


def test_batch_sizes_and_compute_of_the_window_only() -> None:
    before = _reply({"1": 5, "192": 2}, 2000.0)
    after = _reply({"1": 5, "192": 6, "256": 4}, 12_000.0)
    out = gpu_load.stage_figures(before, after, "nsfw", 0.5)
    assert out["batches"] == 8
    assert out["batch_sizes"] == {"192": 4, "256": 4}  # sizes with no batch in the window are left out
    assert out["mean_batch"] == 224.0
    assert out["compute_busy_pct"] == 2.0  # 10 ms of event-timed compute in 0.5 s
