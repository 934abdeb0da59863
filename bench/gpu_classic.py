"""(b) The classic synchronous server: one process, one request at a time, blocking copies from pageable memory.

A plain ZeroMQ REP socket: receive one image's bytes, ``torch.from_numpy(x).cuda()``, run the model (the same
module the torch engine loads, eager, in the config's precision), ``.cpu()``, send the result bytes back. No
batching, no streams, no pinned memory: what a straightforward GPU service does. The clients are the same
16 processes as in (c), each with a REQ socket and one request outstanding.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from shmbroker.bench.common import BenchError, Figures
from shmbroker.bench.procs import Sync, child_setup, spawn_context

READY_TIMEOUT_S = 180.0


def _serve(endpoint: str, model_path: str, device: int, fp16: bool, ready: Any, stop: Any) -> None:
    """The server process: load, bind, set ``ready``, then answer one request at a time until ``stop``."""
    child_setup()
    import torch
    import zmq

    from shmbroker.gpu_worker.engines.torch import TorchEngine

    engine = TorchEngine(model_path, device=device, fp16=fp16, cuda_graphs=False)
    item_shape = engine.inputs[0].item_shape
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.REP)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(endpoint)
    torch.cuda.set_device(device)
    ready.set()
    try:
        with torch.inference_mode():
            while not stop.is_set():
                if not sock.poll(100):
                    continue
                x = np.frombuffer(sock.recv(), dtype=np.float32).reshape(1, *item_shape).copy()
                y = engine.call_module([torch.from_numpy(x).cuda()], 1)[0].float().cpu().numpy()
                sock.send(y.tobytes())
    finally:
        ctx.destroy(linger=0)


class ClassicServer:
    """The server process, started and stopped as a context manager."""

    def __init__(self, endpoint: str, model_path: str, device: int, fp16: bool) -> None:
        ctx = spawn_context()
        self._ready = ctx.Event()
        self._stop = ctx.Event()
        self.endpoint = endpoint
        self._proc = ctx.Process(target=_serve, args=(endpoint, model_path, device, fp16, self._ready, self._stop),
                                 name="shmb-bench-classic", daemon=True)

    def __enter__(self) -> ClassicServer:
        self._proc.start()
        t0 = time.monotonic()
        while not self._ready.wait(1.0):
            if not self._proc.is_alive():
                raise BenchError(f"the classic server exited with code {self._proc.exitcode} before it was ready")
            if time.monotonic() - t0 > READY_TIMEOUT_S:
                raise BenchError("the classic server was not ready in time")
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._proc.join(10.0)
        if self._proc.is_alive():
            self._proc.terminate()
            self._proc.join(5.0)


def client(spec: dict[str, Any], sync: Sync) -> Figures:
    """One REQ socket, one request at a time, for the window; latencies of the counted requests."""
    import zmq

    rng = np.random.default_rng(spec["seed"])
    x = rng.random(tuple(spec["shape"]), dtype=np.float32).tobytes()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(spec["endpoint"])
    try:
        for _ in range(spec["warmup_requests"]):
            sock.send(x)
            sock.recv()
        sync()
        t0 = time.perf_counter()
        t_count, t_end = t0 + spec["warmup_s"], t0 + spec["warmup_s"] + spec["duration_s"]
        w0 = time.monotonic() + spec["warmup_s"]
        samples: list[int] = []
        while True:
            a = time.perf_counter_ns()
            sock.send(x)
            sock.recv()
            b = time.perf_counter_ns()
            now = b / 1e9
            if t_count <= now < t_end:
                samples.append(b - a)
            if now >= t_end:
                break
    finally:
        ctx.destroy(linger=0)
    return {"completed": len(samples), "errors": 0, "samples_ns": samples, "window_s": spec["duration_s"],
            "window_monotonic": [w0, w0 + spec["duration_s"]]}

