"""bench.gpu_lone without a GPU: its options, the medians over rounds and the target it judges on them."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pytest

from shmbroker.bench import gpu_load, gpu_lone
from shmbroker.client import Client
from tests.conftest import TINY_MODELS, running_broker


def parse(*argv: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    gpu_lone.add_arguments(ap)
    return ap.parse_args(list(argv))


def test_the_options_default_to_infer_on_the_torch_engine_and_take_every_api_of_the_gpu_bench() -> None:
    args = parse()
    assert (args.engine, args.api, args.rounds, args.max_batch, args.streams) == ("torch", "infer", 5, 256, 4)
    for api in gpu_load.API_LOOPS:
        assert parse("--api", api).api == api
    with pytest.raises(SystemExit):
        parse("--api", "submit")


def rnd(batch1: float, lone: float, broker: float) -> dict[str, float]:
    return {"batch1_ms": batch1, "lone_ms": lone, "broker_p50_ms": broker, "broker_p99_ms": broker * 2}


def test_the_target_is_the_median_of_each_rounds_excess_over_batch_1() -> None:
    # excesses 0.25, 0.45, 0.28: the median 0.28 passes though one round is past 0.3
    rounds = [rnd(0.50, 0.58, 0.75), rnd(0.48, 0.56, 0.93), rnd(0.49, 0.57, 0.77)]
    s = gpu_lone.summary(rounds)
    assert s["over_batch1_ms"] == pytest.approx(0.28)
    assert s["over_batch1_range_ms"] == [pytest.approx(0.25), pytest.approx(0.45)]
    assert s["broker_p50_ms"] == pytest.approx(0.77) and s["batch1_ms"] == pytest.approx(0.49)
    assert s["target"]["pass"] and s["target"]["target"] == 0.3
    slow = gpu_lone.summary([rnd(0.5, 0.58, 0.85), rnd(0.5, 0.58, 0.81), rnd(0.5, 0.58, 0.70)])
    assert slow["over_batch1_ms"] == pytest.approx(0.31) and not slow["target"]["pass"]
    text = gpu_lone.table(rounds, s)
    assert "PASS" in text and len(text.splitlines()) == 5


def test_no_rounds_or_no_window_is_refused_naming_the_option() -> None:
    with pytest.raises(SystemExit, match="--rounds"):
        gpu_lone.main(parse("--rounds", "0"))
    with pytest.raises(SystemExit, match="--window"):
        gpu_lone.main(parse("--window", "0"))
    with pytest.raises(ValueError, match="--rounds"):
        gpu_lone.summary([])


def test_the_broker_side_times_one_request_at_a_time_with_each_api(tmp_path: Path) -> None:
    """(c) of a round, on a real broker (ONNX Runtime, tiny): every API answers within the window."""
    x = np.random.default_rng(0).random((1, 256), dtype=np.float32)
    with running_broker(tmp_path, models=TINY_MODELS) as b, Client(b.runtime_dir, slots=2) as c:
        for api in gpu_load.API_LOOPS:
            f = gpu_lone.through_broker(c, api, x, 0.3, model="tiny")
            assert f["samples"] > 0 and 0 < f["p50_us"] <= f["p99_us"], (api, f)
