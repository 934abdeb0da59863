"""broker.common.ratelog: a flood of bad messages gives one log line per interval, on the caller's logger."""

from __future__ import annotations

import logging

import pytest

from shmbroker.broker.common.ratelog import RateLimitedLog


def test_one_line_per_interval_with_the_count_dropped(caplog: pytest.LogCaptureFixture,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr("broker.common.ratelog.time.monotonic", lambda: now[0])
    rl = RateLimitedLog(logging.getLogger("gpu_worker.worker"), interval=5.0)
    with caplog.at_level(logging.WARNING, logger="gpu_worker.worker"):
        for _ in range(10):
            rl.warning("dropped a malformed data message: %s", "bad")
        now[0] += 5.0
        rl.warning("dropped a malformed data message: %s", "bad")
    assert [(r.name, r.getMessage()) for r in caplog.records] == [
        ("gpu_worker.worker", "dropped a malformed data message: bad (0 similar dropped)"),
        ("gpu_worker.worker", "dropped a malformed data message: bad (9 similar dropped)"),
    ]
