"""bench/photo_cload.py: the C clients' lines as one window, the binary's check, and a real window of examples/c's
client processes against a live broker's photo model."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path

import pytest

from shmbroker.bench import photo_cload, photos, run
from shmbroker.bench.common import BenchError
from tests.conftest import TEST_MODELS, RunningBroker, photo_model, start_broker
from tests.frontends import C_EXAMPLE, build_c_client, have_libzmq

PHOTO = str(C_EXAMPLE.parent / "chelsea.jpg")


def _line(requests: int, per_s: float, cpu: float, p50: int, p99: int, errors: int = 0) -> dict[str, object]:
    return {"model": "m", "slots": 4, "images": 1, "requests": requests, "errors": errors, "seconds": 2.0,
            "per_s": per_s, "cpu_us_per_request": cpu, "p50_us": p50, "p99_us": p99}


def test_the_lines_merge_into_one_window() -> None:
    out = photo_cload.merge([_line(100, 50.0, 20.0, 1000, 3000), _line(300, 150.0, 40.0, 2000, 9000, errors=2),
                             _line(200, 100.0, 10.0, 1500, 4000)])
    assert out["per_s"] == 300.0 and out["requests"] == 600 and out["errors"] == 2
    assert out["client_cpu_us_per_request"] == pytest.approx((100 * 20 + 300 * 40 + 200 * 10) / 600, abs=0.01)
    assert out["latency"] == {"p50_us": 1500, "p99_us": 9000}
    assert (out["processes"], out["slots_per_process"]) == (3, 4)


def test_a_window_without_requests_is_an_error() -> None:
    with pytest.raises(BenchError, match="no request"):
        photo_cload.merge([_line(0, 0.0, 0.0, 0, 0)])


def test_a_missing_binary_names_the_option(tmp_path: Path) -> None:
    with pytest.raises(BenchError, match=r"--c-client .*make -C examples/c"):
        photo_cload.check_binary(str(tmp_path / "nope"))


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningBroker, Path]]:
    if not have_libzmq():
        pytest.skip("needs a C compiler and libzmq3-dev (.ci/run installs them)")
    binary = build_c_client(tmp_path_factory.mktemp("cbuild"))
    b = start_broker(tmp_path_factory.mktemp("cload"), "process", models=TEST_MODELS + photo_model(1 << 20))
    try:
        yield b, binary
    finally:
        assert b.stop_released() == 0, b.log()


def test_c_client_processes_fill_a_window_on_the_photo_model(live: tuple[RunningBroker, Path]) -> None:
    b, binary = live
    out = photo_cload.run(str(binary), b.runtime_dir, "nsfw_photo", [PHOTO], processes=2, slots=2, duration_s=1.0)
    assert out["processes"] == 2 and out["slots_per_process"] == 2
    assert out["requests"] > 0 and out["errors"] == 0 and out["per_s"] > 0
    assert out["client_cpu_us_per_request"] > 0
    assert 0 < out["latency"]["p50_us"] <= out["latency"]["p99_us"]
    t0, t1 = out["window_monotonic"]
    assert t1 - t0 == pytest.approx(1.0)


def test_a_failing_client_is_a_bench_error_with_its_words(live: tuple[RunningBroker, Path]) -> None:
    b, binary = live
    with pytest.raises(BenchError, match='not of kind "image"'):
        photo_cload.run(str(binary), b.runtime_dir, "nsfw", [PHOTO], processes=1, slots=1, duration_s=0.5)


def test_shmbroker_bench_photos_takes_the_c_client(tmp_path: Path) -> None:
    ap = argparse.ArgumentParser()
    run.add_arguments(ap)
    binary = tmp_path / "shmb_client"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    assert photos.Settings.of(ap.parse_args(["--photos", "--c-client", str(binary)]), gpu=False).c_client == str(binary)
    with pytest.raises(BenchError, match="--c-client"):
        photos.Settings.of(ap.parse_args(["--photos", "--c-client", str(tmp_path / "nope")]), gpu=False)
