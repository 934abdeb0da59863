"""bench.gpu_summary: one line per engine of a GPU bench document, in the order asked, a missing one named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shmbroker.bench import gpu_summary


def _doc(per_s: float, sizes: dict[str, int]) -> dict[str, object]:
    broker = {"per_s": per_s, "gpu_busy_pct": 97.5, "latency": {"p50_us": 40_000.0, "p99_us": 44_800.0},
              "stages": {"mean_batch": 192.0, "compute_busy_pct": 91.2, "batch_sizes": sizes}}
    return {"measurements": {"engines": {"torch": {"broker": broker}}},
            "targets": {"torch": {"c_over_a": {"value": 0.74}, "p99_ms_c": {"bound_ms": 42.7}}}, "failures": []}


def test_runs_print_in_the_order_asked_and_a_missing_one_is_named(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "b.json").write_text(json.dumps(_doc(18_166.0, {"192": 144})))
    (tmp_path / "a.json").write_text(json.dumps(_doc(20_000.0, {"256": 10})))
    assert gpu_summary.main([str(tmp_path), "b", "a", "gone"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == gpu_summary.HEADER
    assert out[1].split()[:10] == ["b", "torch", "18166.0", "0.74", "97.5", "91.2", "40.00", "44.80", "42.7",
                                   "192.0"]
    assert out[1].endswith("{'192': 144}")
    assert out[2].split()[0] == "a"
    assert out[3].split()[:3] == ["gone", "no", "result:"]
