"""``python -m shmbroker.bench.ray_bench``, run briefly in a child (it starts a broker and a Ray node of its own and
sets their environment in its process): the JSON has every path's figures and the ratios over the direct client."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

if not os.environ.get("CI"):  # CI installs the [ray] extra (.ci/run): there a missing Ray fails, never skips
    pytest.importorskip("ray.serve", reason="needs the [ray] extra: pip install -e '.[ray]'")

from tests.conftest import REPO


def test_ray_bench_reports_every_path_and_the_ratios(tmp_path: Path) -> None:
    out = tmp_path / "ray.json"
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
    r = subprocess.run([sys.executable, "-m", "shmbroker.bench.ray_bench", "--quick", "--duration", "0.5", "--out",
                        str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=280, check=False)
    assert r.returncode == 0, r.stderr[-4000:]
    doc = json.loads(out.read_text())
    assert doc["schema"] == "shmbroker-bench-ray/1" and doc["in_flight"] == 32 and doc["model"] == "tiny"
    assert doc["rows"] == 1
    assert list(doc["points"]) == ["direct", "handle", "handle_per_call", "http", "direct_again"]
    for name, p in doc["points"].items():
        assert p["completed"] > 0 and p["errors"] == 0, (name, p)
        assert p["cpu_us_per_request"] > 0 and p["latency"]["samples"] == p["completed"], (name, p)
        assert p["rows_per_s"] == p["per_s"], (name, p)
    s = doc["summary"]
    direct = (doc["points"]["direct"]["per_s"] + doc["points"]["direct_again"]["per_s"]) / 2
    assert s["handle_over_direct"] == round(doc["points"]["handle"]["per_s"] / direct, 3)
    assert s["met"] == (s["handle_over_direct"] >= s["target_handle_over_direct"] == 0.5)
    assert {"handle_added_cpu_us_per_request", "http_added_cpu_us_per_request", "http_added_p50_us"} <= set(s)
    assert doc["broker"]["shm_clean"], doc["broker"]
    assert "handle / direct target >= 0.5" in r.stderr
