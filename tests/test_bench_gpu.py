"""bench.gpu: the options of its client processes, and `shmbroker bench --gpu` takes all of its options."""

from __future__ import annotations

import argparse

import pytest

from shmbroker.bench import gpu


def test_the_api_option_defaults_to_callbacks_and_takes_infer_and_request() -> None:
    ap = argparse.ArgumentParser()
    gpu.add_arguments(ap)
    assert gpu.Settings.of(ap.parse_args([])).api == "call"
    assert gpu.Settings.of(ap.parse_args(["--api", "infer", "--quick"])) == gpu.Settings(2.0, 0.5, 16, 8, api="infer")
    assert gpu.Settings.of(ap.parse_args(["--api", "request"])).api == "request"
    assert gpu.Settings.of(ap.parse_args([])).client_spin_us == 1000
    assert gpu.Settings.of(ap.parse_args(["--client-spin-us", "0"])).client_spin_us == 0
    assert gpu.Settings.of(ap.parse_args([])).worker_nice is None
    assert gpu.Settings.of(ap.parse_args(["--worker-nice", "-10"])).worker_nice == -10
    with pytest.raises(SystemExit):
        ap.parse_args(["--api", "submit"])


def test_shmbroker_bench_gpu_takes_every_option_of_the_gpu_bench() -> None:
    """`shmbroker bench --gpu` hands its options to bench.gpu, so it must parse each of them."""
    from shmbroker.bench import run

    cli, own = argparse.ArgumentParser(), argparse.ArgumentParser()
    run.add_arguments(cli)
    gpu.add_arguments(own)
    missing = {a.dest for a in own._actions} - {a.dest for a in cli._actions}
    assert not missing, f"shmbroker bench lacks the GPU bench's options {sorted(missing)}"
    args = cli.parse_args(["--gpu", "--api", "request", "--streams", "2", "--set", "trim_to_sizes=false",
                           "--client-spin-us", "0"])
    settings = gpu.Settings.of(args)
    assert settings.api == "request" and settings.client_spin_us == 0
    assert args.streams == 2 and args.model_options == ["trim_to_sizes=false"]
