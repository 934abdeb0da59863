"""What an operator's tooling sees: /health over HTTP while an engine fails and recovers, /metrics and
``shmbroker status --json`` against a live broker under load from client processes."""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import signal
import socket
import subprocess
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from shmbroker.broker.common import protocol as P
from shmbroker.broker.common.config import ConfigError, parse
from shmbroker.broker.ops.metrics import worker_families
from shmbroker.gpu_worker.model_source import tiny_model_bytes
from tests.conftest import CLI, REPO, TEST_MODELS, free_port, start_broker, write_config

PROBE_ONCE = "probe_interval_ms = 3000000\nready_max_age_ms = 3600000\n"  # one probe per model, at start


def get(url: str, timeout: float = 120) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return int(r.status), r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def monitoring(port: int, probes: str) -> str:
    return f"[monitoring]\nhttp_port = {port}\n{probes}"


def test_ready_is_503_naming_the_model_while_its_engine_fails_and_200_once_it_recovers(tmp_path: Path) -> None:
    model = tmp_path / "sick.onnx"
    good = tiny_model_bytes()
    model.write_bytes(good)
    port = free_port()
    b = start_broker(tmp_path, "process", extra="", models=f'[models.sick]\npath = "{model}"\nintra_op_threads = 1\n'
                     + monitoring(port, "probe_interval_ms = 300\nprobe_timeout_ms = 2000\nready_max_age_ms = 3000\n"))
    base = f"http://127.0.0.1:{port}"
    try:
        assert get(f"{base}/health/ready?wait=60")[0] == 200
        assert get(f"{base}/health/ready/sick")[0] == 200
        model.write_bytes(b"this is not an ONNX model")  # the worker's restart will fail to load it
        (worker,) = b.worker_pids()
        os.kill(worker, signal.SIGKILL)
        psutil.Process(worker).wait(30)  # gone once the broker reaped it, which marks it down in the same step
        status, body = get(f"{base}/health/ready")
        assert status == 503, body
        assert "sick" in json.loads(body)["models"], body
        assert get(f"{base}/health/ready/sick")[0] == 503
        assert get(f"{base}/health/live")[0] == 200  # the broker itself is fine
        model.write_bytes(good)
        status, body = get(f"{base}/health/ready?wait=90")
        assert status == 200, f"{body}\n{b.log()}"
        assert json.loads(body) == {"ready": True, "models": {}}
        assert get(f"{base}/health/ready/nope")[0] == 404
    finally:
        assert b.stop() == 0


def _load(runtime_dir: str, model: str, stop: Any, started: Any, q: Any) -> None:
    """A client process: sequential requests until ``stop``; reports how many were answered, by outcome."""
    from shmbroker.client import Client, ShmBrokerError

    outcome: Counter[str] = Counter()
    with Client(runtime_dir) as c:
        plan = c.models[model]
        x = {s.name: np.ones((1, *shape), dt) for s, shape, dt in zip(plan.info.inputs, plan.in_item_shapes,
                                                                        plan.in_dtypes, strict=True)}
        started.release()
        while not stop.is_set():
            try:
                c.infer(model, x)
                outcome["OK"] += 1
            except ShmBrokerError as exc:
                outcome[exc.code] += 1
    q.put((model, dict(outcome)))


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    status, text = get(f"http://127.0.0.1:{port}/metrics")
    assert status == 200
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    assert key in samples, f"no sample {key}; have {sorted(k for k in samples if k[0] == name)}"
    return samples[key]


def test_metrics_count_every_request_and_status_reports_queue_and_throughput(tmp_path: Path) -> None:
    port = free_port()
    b = start_broker(tmp_path, "process", models=TEST_MODELS + monitoring(port, PROBE_ONCE))
    ctx = mp.get_context("spawn")
    stop, started, q = ctx.Event(), ctx.Semaphore(0), ctx.Queue()
    loads = [("tiny", 3), ("nsfw", 1)]
    procs = [ctx.Process(target=_load, args=(str(b.runtime_dir), m, stop, started, q)) for m, n in loads
             for _ in range(n)]
    try:
        assert get(f"http://127.0.0.1:{port}/health/ready?wait=60")[0] == 200  # the one probe per model is done
        for p in procs:
            p.start()
        for _ in procs:
            assert started.acquire(timeout=120)
        during = scrape(port)  # parses while the load runs
        assert value(during, "shmbroker_up") == 1.0
        env = dict(os.environ, SHMBROKER_RUNTIME_DIR=str(b.runtime_dir))
        r = subprocess.run([*CLI, "status", "--json", "--interval", "1"], env=env,
                           cwd=REPO, capture_output=True, text=True, check=False, timeout=60)
        assert r.returncode == 0, r.stderr
        snap = json.loads(r.stdout)
        assert snap["ready"] is True
        assert snap["models"]["tiny"]["throughput_rps"] > 0, snap
        assert isinstance(snap["models"]["nsfw"]["queue_depth"], int)
        assert [w["worker_id"] for w in snap["workers"]] == [0] and "queue_depth" in snap["workers"][0]
        view = subprocess.run([*CLI, "status", "--count", "1", "--interval", "0.3"],
                              env=env, cwd=REPO, capture_output=True, text=True, check=False, timeout=60)
        assert view.returncode == 0, view.stderr
        assert "nsfw" in view.stdout and "tiny" in view.stdout and "req/s" in view.stdout
    finally:
        stop.set()
        sent: dict[str, Counter[str]] = {"tiny": Counter(), "nsfw": Counter()}
        for _ in [p for p in procs if p.pid is not None]:
            model, outcome = q.get(timeout=120)
            sent[model].update(outcome)
        for p in procs:
            p.join(30)
    try:
        after = scrape(port)
        probes = {m: value(after, "shmbroker_health_probes_total", model=m, result="ok") for m in sent}
        assert probes == {"tiny": 1.0, "nsfw": 1.0}
        for m, outcome in sent.items():
            assert outcome["OK"] > 0 and set(outcome) == {"OK"}, outcome
            answered = {k[1]: v for k, v in after.items() if k[0] == "shmbroker_requests_total"
                        and dict(k[1])["model"] == m}
            assert sum(answered.values()) == outcome["OK"] + probes[m], answered
            assert value(after, "shmbroker_requests_total", model=m, worker="0", code="OK") == outcome["OK"] + 1
            # every request is one row: the batch-size histogram's rows add up to the same number
            assert value(after, "shmbroker_batch_size_sum", model=m, worker="0") == outcome["OK"] + 1
            assert value(after, "shmbroker_queue_depth", model=m, worker="0") == 0
        assert value(after, "shmbroker_worker_requests_in_flight", worker="0") == 0
        assert value(after, "shmbroker_worker_restarts_total", worker="0") == 0
        assert value(after, "shmbroker_process_resident_memory_bytes", process="worker", worker="0") > 0
        assert value(after, "shmbroker_process_cpu_seconds_total", process="broker", worker="") > 0
    finally:
        assert b.stop() == 0


def test_probe_settings_that_would_flap_are_refused_with_the_key() -> None:
    with pytest.raises(ConfigError, match=r"monitoring\.ready_max_age_ms"):
        parse({"models": {"tiny": {"path": "builtin:tiny"}},
               "monitoring": {"probe_interval_ms": 5000, "ready_max_age_ms": 4000}})


def test_a_taken_health_port_stops_serve_with_the_key(tmp_path: Path) -> None:
    with socket_bound() as port:
        cfg = write_config(tmp_path / "b.toml", extra="", models=TEST_MODELS + monitoring(port, ""))
        env = dict(os.environ, SHMBROKER_RUNTIME_DIR=str(tmp_path / "run"))
        r = subprocess.run([*CLI, "serve", "--config", str(cfg)], env=env, cwd=REPO,
                           capture_output=True, text=True, check=False, timeout=60)
    assert r.returncode == 1
    assert "monitoring.http_port" in r.stderr
    assert list((tmp_path / "run").iterdir()) == []  # nothing left behind


@contextlib.contextmanager
def socket_bound() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_stage_histograms_become_prometheus_histograms_in_seconds() -> None:
    class One(Collector):
        def collect(self) -> Iterator[Metric]:
            stages = {"compute": P.StageHistogram([10.0, 100.0], [1, 2, 3], 6, 1500.0, 900.0)}
            model = P.ModelStats("m", {"OK": 6}, 2, {"1": 1, "5": 1}, 0, stages)
            yield from worker_families([P.WorkerStats(0, 1, 0, [model])])

    registry = CollectorRegistry()
    registry.register(One())
    samples = {(s.name, s.labels.get("le", "")): s.value for f in
               text_string_to_metric_families(generate_latest(registry).decode()) for s in f.samples
               if s.labels.get("stage") == "compute" or s.name.startswith("shmbroker_batch_size")}
    assert samples[("shmbroker_stage_duration_seconds_bucket", "1e-05")] == 1
    assert samples[("shmbroker_stage_duration_seconds_bucket", "0.0001")] == 3
    assert samples[("shmbroker_stage_duration_seconds_bucket", "+Inf")] == 6
    assert samples[("shmbroker_stage_duration_seconds_sum", "")] == pytest.approx(1500e-6)
    assert samples[("shmbroker_batch_size_bucket", "4.0")] == 1 and samples[("shmbroker_batch_size_sum", "")] == 6


def test_status_json_of_models_with_no_batch_yet_has_only_public_keys(tmp_path: Path) -> None:
    b = start_broker(tmp_path, "process")  # warm-up runs no batch the workers count: no request has come yet
    try:
        env = dict(os.environ, SHMBROKER_RUNTIME_DIR=str(b.runtime_dir))
        r = subprocess.run([*CLI, "status", "--json", "--interval", "0.2"], env=env,
                           cwd=REPO, capture_output=True, text=True, check=False, timeout=60)
        assert r.returncode == 0, r.stderr
        models = json.loads(r.stdout)["models"]
        assert sorted(models) == ["nsfw", "tiny"]
        for entry in models.values():
            assert sorted(entry) == ["batches", "latency_us", "mean_batch", "queue_depth", "ready", "reason",
                                     "requests", "throughput_rps", "workers_ready"], entry
            assert entry["batches"] == 0 and entry["mean_batch"] is None and entry["requests"] == {}
    finally:
        assert b.stop() == 0
