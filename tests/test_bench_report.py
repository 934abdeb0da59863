"""The bench's human table: what each ratio is measured against, and no verdict on a quick run's noise."""

from __future__ import annotations

from typing import Any

import pytest

from shmbroker.bench import report


def _doc(quick: bool) -> dict[str, Any]:
    """A run whose nsfw ratio is 1.355 (window noise) and whose tiny latency ratio misses its target."""
    measurements: dict[str, dict[str, Any]] = {
        "echo_latency": {"latency": {"p50_us": 100.0}}, "tiny_latency": {"latency": {"p50_us": 200.0}},
        "echo_throughput": {"per_s": 1000.0}, "tiny_throughput": {"per_s": 1500.0},
        "nsfw_inprocess": {"per_s": 20.0}, "nsfw_throughput": {"per_s": 27.1},
    }
    return {"date": "today", "elapsed_s": 1.0, "measurements": measurements,
            "machine": {"cpu_model": "cpu", "cpu_count": 2, "python": "3.11"},
            "settings": {"quick": quick, "duration_s": 2.0 if quick else 5.0, "latency_requests": 2000},
            "ratios": report.ratios(measurements), "info_ratios": {}}


def test_a_quick_run_shows_each_ratio_against_its_basis_and_judges_none() -> None:
    doc = _doc(quick=True)
    assert not doc["ratios"]["tiny_p50_over_echo_p50"]["pass"]  # the JSON keeps the verdict for tools
    text = report.table(doc)
    assert "FAIL" not in text and "PASS" not in text, text
    for r in doc["ratios"].values():
        assert f"  {r['what']}\n" in text
    assert "nsfw_throughput_over_inprocess_limit" in text and "1.355" in text
    assert "misses the target" in text and "`make bench`" in text


@pytest.mark.parametrize("name", ["tiny_p50_over_echo_p50", "nsfw_throughput_over_inprocess_limit"])
def test_a_full_run_says_pass_or_fail(name: str) -> None:
    line = next(x for x in report.table(_doc(quick=False)).splitlines() if x.startswith(name))
    assert line.endswith("FAIL" if name == "tiny_p50_over_echo_p50" else "PASS"), line


def test_the_photo_row_shows_photos_per_second_and_its_latency_in_ms() -> None:
    doc = _doc(quick=True)
    doc["measurements"]["photo_throughput"] = {"per_s": 8.0, "errors": 0, "size": "1280x960",
                                               "latency": {"p50_us": 1_131_198.9, "p99_us": 1_376_749.9}}
    line = next(x for x in report.table(doc).splitlines() if x.startswith("nsfw_photo"))
    assert "8.0 photos/s of 1280x960 JPEGs" in line and "p50 1,131.2 ms, p99 1,376.7 ms" in line, line
    assert "1,131,198" not in line  # not in the microsecond columns
    doc["measurements"]["photo_throughput"] = {"error": "skipped: the config has no model 'nsfw_photo'"}
    line = next(x for x in report.table(doc).splitlines() if x.startswith("nsfw_photo"))
    assert "SKIPPED" in line, line
