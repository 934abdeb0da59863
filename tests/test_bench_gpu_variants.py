"""The GPU bench's engine columns: each engine's config written as TOML reads back as the same config, with the
model on that engine; a column that lacks what it needs says which option to give."""

from __future__ import annotations

from pathlib import Path

import pytest

from shmbroker.bench import gpu_report, gpu_variants
from shmbroker.bench.gpu import DEFAULT_CONFIG, MODEL
from shmbroker.broker.common import config


def test_each_engine_config_reads_back_equal(tmp_path: Path) -> None:
    cfg = config.load(DEFAULT_CONFIG)
    package = tmp_path / "nsfw.fp16.inductor.pt2"
    for engine, path in (("torch", cfg.model_path(MODEL)), ("inductor", str(package))):
        variant = gpu_variants.engine_config(cfg, MODEL, engine, str(package), max_batch=128, streams=5)
        back = config.load(gpu_variants.write(variant, tmp_path / f"{engine}.toml"))
        assert back.models[MODEL].engine == engine
        assert back.model_path(MODEL) == path
        assert back.models[MODEL].max_batch == 128
        assert back.models[MODEL].streams == 5
        assert back.models[MODEL].max_queue_delay_us == cfg.models[MODEL].max_queue_delay_us
        assert back.worker.devices == cfg.worker.devices
        assert back.broker.worker_start_timeout_ms == cfg.broker.worker_start_timeout_ms


def test_set_options_reach_the_model_and_read_back(tmp_path: Path) -> None:
    cfg = config.load(DEFAULT_CONFIG)
    options = gpu_variants.parse_options(["batching=triton", "max_queue_delay_us = 500", "fp16=true"])
    assert options == {"batching": "triton", "max_queue_delay_us": 500, "fp16": True}
    variant = gpu_variants.engine_config(cfg, MODEL, "torch", options=options)
    back = config.load(gpu_variants.write(variant, tmp_path / "torch.toml")).models[MODEL]
    assert (back.batching, back.max_queue_delay_us, back.fp16) == ("triton", 500, True)
    worker = gpu_variants.engine_config(cfg, MODEL, "torch", options={"worker.spin_us": 0})
    assert config.load(gpu_variants.write(worker, tmp_path / "w.toml")).worker.spin_us == 0


def test_a_bad_set_option_names_the_key() -> None:
    cfg = config.load(DEFAULT_CONFIG)
    with pytest.raises(config.ConfigError, match="KEY=VALUE"):
        gpu_variants.parse_options(["serial"])
    with pytest.raises(config.ConfigError, match="no_such_key"):
        gpu_variants.engine_config(cfg, MODEL, "torch", options=gpu_variants.parse_options(["no_such_key=1"]))
    with pytest.raises(config.ConfigError, match="no section 'workers'"):
        gpu_variants.engine_config(cfg, MODEL, "torch", options={"workers.spin_us": 0})
    with pytest.raises(config.ConfigError, match="max_batch"):
        gpu_variants.engine_config(cfg, MODEL, "torch", options=gpu_variants.parse_options(["max_batch=zero"]))


def test_a_column_without_its_model_file_names_the_option() -> None:
    cfg = config.load(DEFAULT_CONFIG)
    with pytest.raises(config.ConfigError, match="--inductor PATH"):
        gpu_variants.engine_config(cfg, MODEL, "inductor")
    on_package = gpu_variants.engine_config(cfg, MODEL, "inductor", "nsfw.pt2")
    with pytest.raises(config.ConfigError, match="torch column needs"):
        gpu_variants.engine_config(on_package, MODEL, "torch")


def test_targets_compare_each_engine_with_its_own_best_batch() -> None:
    limit = {"items_per_s": 40_000.0, "max_batch_ms": 0.7, "concurrent_streams": {"items_per_s": 50_000.0}}
    broker = {"per_s": 36_000.0, "gpu_busy_pct": 95.0, "latency": {"p99_us": 3_500.0}, "max_queue_delay_ms": 1.0}
    t = gpu_report.targets({"limit": limit, "broker": broker}, {"per_s": 300.0})
    assert t["c_over_a"]["value"] == 0.9 and t["c_over_a"]["pass"]
    assert t["c_over_b"]["value"] == 120.0 and t["c_over_b"]["pass"]
    assert t["p99_ms_c"]["bound_ms"] == 3.8 and t["p99_ms_c"]["pass"]  # 4 x 0.7 ms + the 1 ms delay
    assert not gpu_report.targets({"limit": limit, "broker": {**broker, "per_s": 35_000.0}})["c_over_a"]["pass"]
    assert gpu_report.targets({"limit": limit}, None)["c_over_a"]["value"] is None


def test_the_lone_target_reads_only_a_run_of_one_request_at_a_time() -> None:
    limit = {"items_per_s": 2_000.0, "by_batch": {"1": {"ms_per_batch": 0.49}, "8": {"ms_per_batch": 0.7}},
             "lone": {"p50_ms": 0.58}}
    lone_run = {"per_s": 900.0, "clients": 1, "in_flight_per_client": 1, "latency": {"p50_us": 780.0}}
    t = gpu_report.targets({"limit": limit, "broker": lone_run})["p50_ms_lone"]
    assert t["bound_ms"] == 0.79 and t["value"] == 0.78 and t["pass"]  # batch 1 in-process, 0.49 ms, + 0.3 ms
    assert t["lone_copies_ms"] == 0.58  # one request at a time with its copies: information only
    slow = gpu_report.targets({"limit": limit, "broker": {**lone_run, "latency": {"p50_us": 880.0}}})
    assert not slow["p50_ms_lone"]["pass"]  # within 0.3 ms of the copies' figure, not of batch 1
    loaded = gpu_report.targets({"limit": limit, "broker": {**lone_run, "clients": 16}})["p50_ms_lone"]
    assert loaded["value"] is None and not loaded["pass"]
