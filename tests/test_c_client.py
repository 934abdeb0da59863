"""examples/c against a live broker, in both modes (its own ring; inline frames through `shmbroker inline`):
built with its Makefile, run as a separate process, its printed scores compared with the Python client's."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from shmbroker.client import Client
from tests.conftest import REPO, TEST_MODELS, RunningBroker, photo_model, start_broker
from tests.frontends import broker_with_gateway, build_c_client, have_libzmq

pytestmark = pytest.mark.skipif(not have_libzmq(), reason="needs a C compiler and libzmq3-dev (.ci/run installs them)")


@pytest.fixture(scope="module")
def binary(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_c_client(tmp_path_factory.mktemp("cbuild"))


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningBroker]:
    """A broker, and the inline gateway on it for the C client's second mode."""
    with broker_with_gateway(tmp_path_factory.mktemp("cbroker")) as (b, _endpoints):
        yield b


def _run(binary: Path, b: RunningBroker, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, SHMBROKER_RUNTIME_DIR=str(b.runtime_dir))
    return subprocess.run([str(binary), *args], env=env, capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.parametrize("mode", ["shm", "inline"])
@pytest.mark.parametrize("rows", [1, 3])
def test_c_client_scores_match_the_python_client(binary: Path, live: RunningBroker, tmp_path: Path, rows: int,
                                                 mode: str) -> None:
    x = np.random.default_rng(rows).random((rows, 224, 224, 3), dtype=np.float32)
    path = tmp_path / "input.f32"
    x.tofile(path)
    r = _run(binary, live, *(["--inline"] if mode == "inline" else []), "nsfw", str(path))
    assert r.returncode == 0, r.stderr
    printed = np.array([[float(v) for v in line.split()] for line in r.stdout.splitlines()], np.float32)
    with Client(live.runtime_dir) as c:
        expected = np.asarray(c.infer("nsfw", x))
    assert printed.shape == (rows, 2)
    np.testing.assert_allclose(printed, expected, rtol=0, atol=1e-5)


def test_c_client_reports_errors(binary: Path, live: RunningBroker, tmp_path: Path) -> None:
    path = tmp_path / "input.f32"
    np.zeros((1, 256), np.float32).tofile(path)
    r = _run(binary, live, "nsfw", str(path))  # not whole rows of nsfw's input
    assert r.returncode == 1 and "whole rows" in r.stderr
    r = _run(binary, live, "nope", str(path))
    assert r.returncode == 1 and "does not serve" in r.stderr
    r = _run(binary, live, "tiny", str(path))
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.split()) == 256
    r = _run(binary, live, "--inline", "nope", str(path))
    assert r.returncode == 1 and "does not serve" in r.stderr


@pytest.fixture(scope="module")
def photos(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningBroker]:
    """A broker that serves the photo model too."""
    b = start_broker(tmp_path_factory.mktemp("cphotos"), "process", models=TEST_MODELS + photo_model(1 << 20))
    try:
        yield b
    finally:
        assert b.stop_released() == 0, b.log()


def test_c_client_load_mode_reports_a_window_and_bad_images(binary: Path, photos: RunningBroker,
                                                            tmp_path: Path) -> None:
    live = photos
    photo = str(REPO / "examples" / "chelsea.jpg")
    r = _run(binary, live, "--load", "1", "3", "nsfw_photo", photo)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout.strip().splitlines()[-1])
    assert (doc["model"], doc["slots"], doc["images"], doc["errors"]) == ("nsfw_photo", 3, 1, 0)
    assert doc["requests"] > 0 and doc["per_s"] > 0 and doc["cpu_us_per_request"] > 0
    assert 0 < doc["p50_us"] <= doc["p99_us"]
    bad = tmp_path / "bad.jpg"
    bad.write_bytes(b"not a photo at all")
    r = _run(binary, live, "--load", "0.5", "2", "nsfw_photo", str(bad))
    assert r.returncode == 3 and "status 14" in r.stderr and "not a JPEG or PNG" in r.stderr, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1])["errors"] > 0
    r = _run(binary, live, "--load", "1", "2", "nsfw", photo)
    assert r.returncode == 1 and 'not of kind "image"' in r.stderr

