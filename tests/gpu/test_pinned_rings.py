"""Page-locked memory per client on a GPU: 16 default clients of open-nsfw at max_batch 256 against a GPU worker.

The worker page-locks each session's whole ring at its first batch (``cudaHostRegister``); a default session's
ring is at most ``[sessions] default_ring_mib`` (64 MiB), where slots of max_batch rows took 2.3 GiB each. The
figure is read from the worker process's own mappings of the rings (``/proc/PID/smaps``: size, and the pages
resident there, which registration faults in). A 256-row request from a default client is still answered,
sent as parts, through every API. Skipped where there is no CUDA device (CI); run on the H100 or H200 machine.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import numpy as np
import pytest

from shmbroker.broker.common.ring import NAME_PREFIX
from shmbroker.gpu_worker import cuda
from tests.conftest import RunningBroker, arr, start_broker
from tests.gpu.clients import NSFW

pytestmark = pytest.mark.skipif(not cuda.available(), reason="needs a CUDA device and cuda-python")

MIB = 1 << 20
CLIENTS = 16
ROWS = 256
TOL = 1e-4  # fp32 PyTorch (TF32 off) against fp32 ONNX Runtime
MODELS = (f'[models.nsfw]\npath = "{NSFW}"\nengine = "torch"\nmax_batch = {ROWS}\nstreams = 2\n'
          "cuda_graphs = false\nmax_queue_delay_us = 2000\nmax_queue_size = 1024\ntimeout_ms = 60000\n")


@pytest.fixture(scope="module")
def gpu_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningBroker]:
    """The broker's own [sessions] defaults (16 slots, default_ring_mib = 64), one GPU worker."""
    pytest.importorskip("torch")
    pytest.importorskip("onnx2torch")
    b = start_broker(tmp_path_factory.mktemp("pinned"), "process", extra="[worker]\ndevices = [0]\n", models=MODELS,
                     sessions="")
    try:
        yield b
    finally:
        rc = b.stop_released()
        assert rc == 0, f"broker exited {rc}\n{b.log()}"


def ring_mappings(pid: int, instance: str) -> dict[str, tuple[int, int]]:
    """The rings of broker ``instance`` that process ``pid`` maps: name -> (bytes mapped, bytes resident)."""
    prefix = f"/memfd:{NAME_PREFIX}{instance}-"
    found: dict[str, tuple[int, int]] = {}
    name = ""
    size = 0
    with open(f"/proc/{pid}/smaps") as smaps:
        for line in smaps:
            head = line.split()
            if not head:
                continue
            if not head[0].endswith(":"):  # a mapping's first line: address range, perms, ..., path
                at = line.find(prefix)
                name = line[at + len("/memfd:"):].strip().removesuffix(" (deleted)") if at >= 0 else ""
            elif name and head[0] == "Size:":
                size = int(head[1]) * 1024
            elif name and head[0] == "Rss:":
                mapped, resident = found.get(name, (0, 0))
                found[name] = (mapped + size, resident + int(head[1]) * 1024)
    return found


def _reference(x: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    from shmbroker.gpu_worker.model_source import resolve

    sess = ort.InferenceSession(resolve(NSFW), providers=["CPUExecutionProvider"])
    out: np.ndarray = sess.run(None, {"input:0": x})[0]
    return out


def test_sixteen_default_clients_pin_at_most_64_mib_each(gpu_broker: RunningBroker) -> None:
    from shmbroker.client import Client

    x = np.random.default_rng(1).random((1, 224, 224, 3), dtype=np.float32)
    clients: list[Client] = []
    try:
        for _ in range(CLIENTS):
            clients.append(Client(str(gpu_broker.runtime_dir)))
        for c in clients:  # a session's first batch registers its whole ring in the worker
            assert arr(c.infer("nsfw", x)).shape == (1, 2)
        (worker,) = gpu_broker.worker_pids()
        rings = ring_mappings(worker, gpu_broker.instance)
        mapped = sum(m for m, _ in rings.values())
        resident = sum(r for _, r in rings.values())
        sizes = [c.segment.layout.total_bytes for c in clients]
        print(f"{CLIENTS} default clients of open-nsfw at max_batch {ROWS}: {clients[0].slots} slots of "
              f"{clients[0].max_items} rows, {sizes[0] / MIB:.1f} MiB a ring; the GPU worker maps {len(rings)} rings, "
              f"{mapped / MIB:.0f} MiB, {resident / MIB:.0f} MiB of it resident (page-locked); slots of {ROWS} rows "
              f"took {CLIENTS} x 2352 MiB = {CLIENTS * 2352 / 1024:.1f} GiB")
        assert len(rings) == CLIENTS, sorted(rings)
        assert max(sizes) <= 64 * MIB
        assert mapped == sum(sizes) <= CLIENTS * 64 * MIB
        assert resident <= mapped
        assert "cudaHostRegister" not in gpu_broker.log(), gpu_broker.log()  # every registration succeeded
    finally:
        for c in clients:
            c.close()


def test_a_default_client_serves_256_rows_through_every_api(gpu_broker: RunningBroker) -> None:
    from shmbroker.client import AsyncClient, BadInput, Client
    from shmbroker.client.client import Outputs
    from shmbroker.client.errors import ShmBrokerError
    from tests.gpu.photos import noise

    x = noise(np.random.default_rng(2), ROWS)
    want = _reference(x)
    rd = str(gpu_broker.runtime_dir)
    with Client(rd) as c:
        assert c.max_items < ROWS  # the request goes as parts
        got = {"infer": arr(c.infer("nsfw", x)), "submit": arr(c.submit("nsfw", x).result(120))}
        done = threading.Event()
        called: list[tuple[Outputs | None, ShmBrokerError | None]] = []

        def callback(out: Outputs | None, err: ShmBrokerError | None) -> None:
            called.append((out, err))
            done.set()

        c.call("nsfw", x, callback)
        assert done.wait(120)
        (out, err), = called
        assert err is None, err
        got["call"] = arr(out)
        with pytest.raises(BadInput, match=r"Client\(max_items=\.\.\.\)"), c.request("nsfw", rows=ROWS):
            pass

    async def on_a_loop() -> Outputs:
        async with AsyncClient(rd) as ac:
            return await ac.infer("nsfw", x)

    got["AsyncClient"] = arr(asyncio.run(on_a_loop()))
    for api, y in got.items():
        err_max = float(np.abs(y - want).max())
        print(f"{api}: {ROWS} rows, max abs error {err_max:.2e}")
        assert y.shape == (ROWS, 2) and err_max <= TOL, api
