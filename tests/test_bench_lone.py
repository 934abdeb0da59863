"""bench.lone: one round against a real broker and ONNX Runtime, with idle dispatch on and off, writes every
figure and the target into its JSON document."""

from __future__ import annotations

import json
from pathlib import Path

from shmbroker.bench import lone


def test_one_round_measures_all_four_and_the_target(tmp_path: Path) -> None:
    out = tmp_path / "lone.json"
    assert lone.main(["--model", "tiny", "--requests", "5", "--rounds", "1", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    (r,) = doc["rounds"]
    for key in ("in_process_1_threads_ms", "in_process_2_threads_ms", "broker_idle_dispatch_on_ms",
                "broker_idle_dispatch_off_ms"):
        assert r[key] > 0, key
    best = min(r["in_process_1_threads_ms"], r["in_process_2_threads_ms"])
    assert r["idle_on_over_best_in_process"] == round(r["broker_idle_dispatch_on_ms"] / best, 3)
    assert doc["target"]["target"] == lone.TARGET and doc["target"]["value"] == r["idle_on_over_best_in_process"]
