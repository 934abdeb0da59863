"""End to end on a GPU: a real broker with ``worker.devices = [0]`` serving models on the PyTorch engine through
the stream pipeline, eight client processes at once, each checking its own results against ONNX Runtime on
the CPU. Skipped where there is no CUDA device (CI); run on the H200 machine (see bench/README.md)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from shmbroker.gpu_worker import cuda
from tests.conftest import RunningBroker, run_client_processes, start_broker
from tests.gpu.clients import CLIENTS, NSFW, REQUESTS, checked_client
from tests.models import W, two_io_model

pytestmark = pytest.mark.skipif(not cuda.available(), reason="needs a CUDA device and cuda-python")

TOL = {"nsfw32": 1e-4, "nsfw16": 1e-2}


def _models(two: Path) -> str:
    common = "engine = \"torch\"\nmax_queue_delay_us = 2000\nmax_queue_size = 1024\ntimeout_ms = 60000\n"
    # nsfw32: batches fill on the device, their rows copied as they come, and compute side by side; nsfw16: a
    # max_batch of 12, whose graph sizes (1..8, 10, 12) make a batch formed while another runs take fewer rows
    # than are queued
    return (f'[models.nsfw32]\npath = "{NSFW}"\n{common}max_batch = 8\nstreams = 4\nearly_copies = true\n'
            'serial_compute = false\n'
            f'[models.nsfw16]\npath = "{NSFW}"\n{common}max_batch = 12\nstreams = 3\nfp16 = true\n'
            f'[models.two]\npath = "{two}"\n{common}max_batch = 8\nstreams = 2\n')


@pytest.fixture(scope="module")
def gpu_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningBroker]:
    pytest.importorskip("torch")
    pytest.importorskip("onnx2torch")
    tmp = tmp_path_factory.mktemp("gpu-broker")
    b = start_broker(tmp, "process", extra="[worker]\ndevices = [0]\n", models=_models(two_io_model(tmp / "two.onnx")))
    try:
        yield b
    finally:
        rc = b.stop_released()
        assert rc == 0, f"broker exited {rc}\n{b.log()}"


def test_eight_clients_get_their_own_results_in_fp32_and_fp16(gpu_broker: RunningBroker) -> None:
    runtime_dir = str(gpu_broker.runtime_dir)
    results = run_client_processes(checked_client, [(seed, runtime_dir, TOL) for seed in range(CLIENTS)], 240)
    assert sorted(r[0] for r in results) == list(range(CLIENTS))
    for seed, errors, wrong, distinct, n_real in results:
        print(f"client {seed}: max abs fp32 {errors['nsfw32']:.2e}, fp16 {errors['nsfw16']:.2e}; "
              f"{distinct:.1%} of row pairs tell a mix-up at the fp32 tolerance; {n_real} real photographs")
        assert not wrong, wrong
        assert distinct > 0.9, f"client {seed}: inputs too alike to detect a mix-up"
    stats = {m.name: m for w in gpu_broker.stats().workers for m in w.models}
    for name in TOL:
        m = stats[name]
        rows = sum(int(k) * v for k, v in m.batch_items.items())
        assert m.requests.get("OK", 0) >= CLIENTS * REQUESTS, m.requests
        assert rows / m.batches > 1.0, f"{name}: batches did not form ({m.batch_items})"
        assert m.stages["queue"].count == m.requests["OK"]
        for stage in ("h2d", "wait", "compute", "d2h", "answer"):
            assert m.stages[stage].count == m.batches, (stage, m.stages[stage].count, m.batches)


def test_two_inputs_two_outputs_through_the_pipeline(gpu_broker: RunningBroker) -> None:
    from shmbroker.client import Client

    rng = np.random.default_rng(5)
    with Client(str(gpu_broker.runtime_dir), slots=8, max_items=8) as c:
        cases = []
        for rows in (1, 3, 8, 2):
            a = rng.standard_normal((rows, 4), dtype=np.float32)
            b = rng.standard_normal((rows, 2), dtype=np.float32)
            cases.append((a, b, c.submit("two", {"a": a, "b": b})))
        for a, b, fut in cases:
            out = fut.result(60)
            assert isinstance(out, dict)
            np.testing.assert_allclose(out["y"], a @ W + b, rtol=0, atol=1e-5)
            np.testing.assert_allclose(out["r"], np.maximum(a, 0), rtol=0, atol=0)


def test_worker_process_selected_the_device(gpu_broker: RunningBroker) -> None:
    """The worker holds a CUDA context on GPU 0 (nvidia-smi lists its pid) while the broker holds none."""
    pynvml = pytest.importorskip("pynvml")
    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        pids = {p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)}
    finally:
        pynvml.nvmlShutdown()
    workers = set(gpu_broker.worker_pids())
    if not pids:
        pytest.skip("NVML lists no compute processes on this machine")
    assert pids & workers, f"GPU 0 processes {pids}, worker pids {workers}"
    assert gpu_broker.proc.pid not in pids
