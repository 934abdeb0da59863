"""bench.inprocess: the sweep names its best shape and batch size, and Pinned measures exactly that again."""

from __future__ import annotations

import io
import os
from collections.abc import Callable

from shmbroker.bench import inprocess, paired, report
from shmbroker.bench.common import Figures, Progress
from shmbroker.broker.common import config


def test_pinned_measures_the_sweeps_best_shape_and_batch_size_with_real_onnxruntime():
    cfg = config.load(config.DEFAULT_CONFIG)
    sweep = inprocess.limit(cfg, "tiny", [1, 4], 0.3, Progress(io.StringIO()))
    cores = len(os.sched_getaffinity(0))
    assert sweep["best_shape"] in sweep["by_shape"]
    assert (sweep["best_instances"], sweep["best_intra_op_threads"]) in {(1, 1), (1, cores)}
    assert sweep["items_per_s"] == sweep["by_shape"][sweep["best_shape"]][str(sweep["best_batch"])]["items_per_s"]
    with inprocess.Pinned(cfg, "tiny", sweep) as pinned:
        first = pinned.measure(0.1)
        second = pinned.measure(0.1)
    for w in (first, second):
        assert w["shape"] == sweep["best_shape"] and w["batch"] == sweep["best_batch"]
        assert w["runs"] >= inprocess.MIN_RUNS and w["seconds"] > 0
        assert abs(w["per_s"] - w["runs"] * w["batch"] / w["seconds"]) <= 0.01 * w["per_s"]  # seconds rounded
        assert "errors" not in w  # no requests: the merged row shows no error count


def test_the_nsfw_target_is_the_paired_median_against_the_pinned_windows_not_the_sweep():
    store: dict[str, Figures] = {"nsfw_inprocess_sweep": {"items_per_s": 100.0, "best_batch": 8, "by_batch": {}}}
    windows = {"nsfw_inprocess": iter([80.0, 70.0, 60.0, 50.0]), "nsfw_throughput": iter([75.0, 52.0, 44.0])}

    def side(key: str) -> paired.Side:
        return paired.Side(key, key, lambda: {"per_s": next(windows[key])}, lambda f: "")

    def phase(key: str, _title: str, fn: Callable[[], Figures], _summary: object) -> None:
        store[key] = fn()

    pair = paired.Pair(side("nsfw_inprocess"), side("nsfw_throughput"), ("per_s",))
    paired.run(pair, 3, phase)
    paired.merge(store, pair, 3)
    assert store["nsfw_throughput"]["paired"]["per_s"]["per_round"] == [1.0, 0.8, 0.8]
    r = report.ratios(store)["nsfw_throughput_over_inprocess_limit"]
    assert r["value"] == 0.8 and r["pass"] is False
    assert r["denominator"] == "nsfw_inprocess.per_s"
    assert report.info_ratios(store)["nsfw_throughput_over_sweep_best"] == 0.52  # median 52 over the sweep's 100
    assert "errors" not in store["nsfw_inprocess"]
