"""bench.gpu: the options of its client processes."""

from __future__ import annotations

import argparse

import pytest

from shmbroker.bench import gpu


def test_the_api_option_defaults_to_callbacks_and_takes_infer() -> None:
    ap = argparse.ArgumentParser()
    gpu.add_arguments(ap)
    assert gpu.Settings.of(ap.parse_args([])).api == "call"
    assert gpu.Settings.of(ap.parse_args(["--api", "infer", "--quick"])) == gpu.Settings(2.0, 0.5, 16, 8, api="infer")
    with pytest.raises(SystemExit):
        ap.parse_args(["--api", "submit"])
