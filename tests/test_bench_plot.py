"""``shmbroker bench --plot``: the concurrency sweep against a live broker, its figures and its PNG.

The sweep runs with tiny windows here; the assertions are about shape (one point per concurrency, a
valid PNG), never about speed: the machine is shared.
"""

from __future__ import annotations

import io
import json
import struct
import sys
from pathlib import Path

import pytest

from shmbroker.bench import plot, sweep
from shmbroker.bench.common import BenchError, Progress
from shmbroker.broker.cli import main as cli_main
from tests.conftest import RunningBroker

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_split_spreads_in_flight_over_at_most_four_processes():
    assert sweep.split(1) == [1]
    assert sweep.split(2) == [1, 1]
    assert sweep.split(8) == [2, 2, 2, 2]
    assert sweep.split(10) == [3, 3, 2, 2]
    with pytest.raises(ValueError):
        sweep.split(0)


def test_sweep_figures_and_png(process_broker: RunningBroker, tmp_path: Path):
    concurrencies = (1, 3, 8)
    plan = sweep.Plan("tiny", concurrencies, warmup_s=0.1, warmup_requests=5)
    stderr = io.StringIO()
    figures = sweep.sweep(Progress(stderr), str(process_broker.runtime_dir), plan, 0.3, process_broker.stats)

    doc = json.loads(json.dumps({  # what goes into the JSON document must survive it
        "date": "2026-01-01T00:00:00Z", "machine": {"cpu_model": "test", "cpu_count": 2},
        "measurements": {"tiny_sweep": figures, "nsfw_sweep": {"error": "skipped: not in this test"}},
    }))
    points = doc["measurements"]["tiny_sweep"]["points"]
    assert [p["concurrency"] for p in points] == list(concurrencies)
    assert [p["processes"] for p in points] == [1, 3, 4]
    for p in points:
        assert p["per_s"] > 0
        assert p["latency"]["samples"] > 0
        assert p["latency"]["p99_us"] >= p["latency"]["p50_us"] > 0
        assert p["errors"] == 0 and "lost" not in p
        assert p["server_batches"] > 0  # the worker's counters, per round
    assert "point 3/3: 8 in flight" in stderr.getvalue()
    assert "sweep: tiny" in sweep.table(doc["measurements"])

    out = tmp_path / "sub" / "sweep.png"
    plot.write(doc, out)  # the errored nsfw sweep is left out, not drawn
    data = out.read_bytes()
    assert data[:8] == PNG_MAGIC and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert 300 <= width <= 2000 and 200 <= height <= 1500
    assert 5_000 < len(data) < 150_000


def test_plot_without_matplotlib_names_the_extra(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    with pytest.raises(BenchError, match=r"shmbroker\[plot\]"):
        plot.require()
    # the command refuses before it starts anything
    assert cli_main(["bench", "--plot", str(tmp_path / "x.png")]) == 2
    assert "pip install 'shmbroker[plot]'" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_plot_with_no_sweep_is_an_error(tmp_path: Path):
    with pytest.raises(BenchError, match="no sweep"):
        plot.draw([], tmp_path / "x.png", "empty")
