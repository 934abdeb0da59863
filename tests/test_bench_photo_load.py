"""bench.photo_load against a real broker, in both worker modes: (b)'s clients send the set's JPEG bytes and (c)'s
decode them with Pillow into the tensor model; every answer inside the window counts, with no error; the rounds
client runs its windows between the bench's. And the main bench's photo phase is skipped, not failed, for a
config without the photo model."""

from __future__ import annotations

import io
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from shmbroker.bench import photo_load, photoset
from shmbroker.bench.common import Progress
from shmbroker.bench.run import Bench, Settings
from shmbroker.broker.common import config
from shmbroker.client import Client
from tests.conftest import TEST_MODELS, RunningBroker, photo_model, start_broker

MODELS = TEST_MODELS + photo_model(1 << 20, timeout_ms=20000)


@pytest.fixture(scope="module", params=["process", "thread"])
def photo_broker(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[RunningBroker]:
    b = start_broker(tmp_path_factory.mktemp(f"bench-photos-{request.param}"), str(request.param), models=MODELS)
    try:
        yield b
    finally:
        assert b.stop_released() == 0, b.log()


@pytest.fixture(scope="module")
def photo_paths(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    sets = photoset.build([(320, 240)], tmp_path_factory.mktemp("photoset"), Progress(io.StringIO()))
    return [str(p) for p in sets[(320, 240)].paths[:6]]


def _spec(b: RunningBroker, model: str, paths: list[str], index: int = 0) -> dict[str, Any]:
    return {"index": index, "processes": 2, "seed": 1, "runtime_dir": str(b.runtime_dir), "model": model,
            "paths": paths, "preset": "opennsfw", "in_flight": 3, "warmup_s": 0.1, "duration_s": 1.0,
            "warmup_requests": 2}


@pytest.mark.parametrize(("target", "model"), [(photo_load.encoded_client, "nsfw_photo"),
                                                (photo_load.pillow_client, "nsfw")])
def test_a_client_process_counts_its_windows_answers(photo_broker: RunningBroker, photo_paths: list[str],
                                                     target: Any, model: str) -> None:
    out = target(_spec(photo_broker, model, photo_paths, index=1), lambda: None)
    assert out["errors"] == 0 and out["lost"] == 0, out["error_codes"]
    assert out["completed"] == len(out["samples_ns"]) > 0
    assert out["answered"] >= out["completed"] and out["cpu_s"] > 0
    w0, w1 = out["window_monotonic"]
    assert w1 - w0 == pytest.approx(1.0)


def test_a_client_process_can_send_several_photos_a_request(photo_broker: RunningBroker,
                                                            photo_paths: list[str]) -> None:
    spec = {**_spec(photo_broker, "nsfw_photo", photo_paths, index=0), "photos_per_request": 3}
    out = photo_load.encoded_client(spec, lambda: None)
    assert out["errors"] == 0 and out["lost"] == 0, out["error_codes"]
    assert out["completed"] > 0
    c = Client(photo_broker.runtime_dir)
    try:
        chains = photo_load.PhotoChains(c, "nsfw_photo", [b"a", b"b", b"c", b"d"], 2, 1, per_request=3)
        assert chains.inputs() == [b"c", b"d", b"a"] and chains.inputs() == [b"b", b"c", b"d"]
    finally:
        c.close()


def test_the_rounds_client_runs_one_window_per_round_on_the_benchs_barrier(photo_broker: RunningBroker,
                                                                          photo_paths: list[str]) -> None:
    barrier = threading.Barrier(2)
    seen: list[str] = []

    def bench() -> None:  # the bench's seat: ready, then each window's start and end
        barrier.wait(60)
        for r in range(2):
            seen.append(f"a{r}")
            barrier.wait(60)
            barrier.wait(60)
        seen.append("a2")

    seat = threading.Thread(target=bench)
    seat.start()
    spec = {**_spec(photo_broker, "nsfw_photo", photo_paths), "rounds": 2, "round_barrier": barrier,
            "round_timeout_s": 60.0}
    out = photo_load.encoded_rounds_client(spec, lambda: None)
    seat.join(60)
    assert seen == ["a0", "a1", "a2"] and len(out["rounds"]) == 2
    first, second = out["rounds"]
    for w in out["rounds"]:
        assert w["errors"] == 0 and w["lost"] == 0, w["error_codes"]
        assert w["answered"] >= spec["in_flight"]  # each chain's last request, answered in the drain at least
    assert second["window_monotonic"][0] >= first["window_monotonic"][1]


def test_the_main_benchs_photo_phase_is_skipped_without_the_model(tmp_path: Path) -> None:
    cfg_path = tmp_path / "no-photos.toml"
    cfg_path.write_text(TEST_MODELS)
    cfg = config.load(cfg_path)
    s = Settings(quick=True, duration_s=1.0, warmup_s=0.1, latency_requests=10, latency_warmup=1, inprocess_s=1.0,
                 rounds=1)
    bench = Bench(cfg, cfg_path, s, Progress(io.StringIO()))
    bench._photo_phase(None)  # type: ignore[arg-type]  # never reaches the broker
    assert bench.measurements["photo_throughput"] == {"error": "skipped: the config has no model 'nsfw_photo'"}
    assert bench.failures == []
