"""The baseline: a raw pyzmq DEALER -> ROUTER echo over ipc:// of a SUBMIT-sized two-frame message.

The server is one process running the plainest loop (blocking ``recv_multipart``, ``send_multipart``
back); clients are spawned processes (see bench.procs). This is what one request costs with ZeroMQ and
Python and nothing else: no shared memory, no batching, no model.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from multiprocessing.context import SpawnProcess
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any

import zmq

from shmbroker.bench.common import BenchError, Figures, latency_summary, submit_sized_message
from shmbroker.bench.procs import Sync, child_setup, spawn_context

STOP = b"STOP"
REPLY_TIMEOUT_MS = 5000


def _serve(endpoint: str, ready: Event, with_tiny: bool = False) -> None:
    """The echo loop; ``with_tiny`` also runs the tiny model once per message (the floor of any server)."""
    child_setup()
    run = _tiny_runner() if with_tiny else None
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(endpoint)
    ready.set()
    try:
        while True:
            frames = sock.recv_multipart()
            if len(frames) == 2 and frames[1] == STOP:
                return
            if run is not None:
                run()
            sock.send_multipart(frames)
    finally:
        ctx.destroy(linger=0)


def _tiny_runner() -> Callable[[], object]:
    """One-row inference of the tiny model with the worker's own engine settings, nothing else."""
    import numpy as np

    from shmbroker.gpu_worker.engines.onnxruntime import OnnxRuntimeEngine
    from shmbroker.gpu_worker.model_source import tiny_model_bytes

    engine = OnnxRuntimeEngine(tiny_model_bytes(), intra_op_threads=1)
    feeds = {"x": np.zeros((1, 256), np.float32)}
    return lambda: engine.run(feeds)


class EchoServer:
    """The echo ROUTER in its own spawned process, bound to ``ipc://DIR/echo.sock``."""

    def __init__(self, directory: Path, with_tiny: bool = False) -> None:
        name = "floor" if with_tiny else "echo"
        self.endpoint = f"ipc://{directory / (name + '.sock')}"
        ctx = spawn_context()
        self._ready = ctx.Event()
        self._proc: SpawnProcess = ctx.Process(target=_serve, args=(self.endpoint, self._ready, with_tiny),
                                               name=f"shmb-bench-{name}", daemon=True)

    def __enter__(self) -> EchoServer:
        self._proc.start()
        if not self._ready.wait(60.0):
            self._proc.terminate()
            raise BenchError(f"the echo server did not bind {self.endpoint} within 60 s "
                             f"(exit code {self._proc.exitcode})")
        return self

    def __exit__(self, *exc: object) -> None:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        try:
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 1000)
            sock.connect(self.endpoint)
            with contextlib.suppress(zmq.ZMQError):
                sock.send(STOP)
            sock.close()
        finally:
            ctx.term()
        self._proc.join(5.0)
        if self._proc.is_alive():
            self._proc.terminate()
            self._proc.join(5.0)


def _dealer(endpoint: str) -> tuple[zmq.Context[zmq.Socket[bytes]], zmq.Socket[bytes]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return ctx, sock


def _roundtrip(sock: zmq.Socket[bytes], frames: list[bytes]) -> None:
    sock.send_multipart(frames)
    if not sock.poll(REPLY_TIMEOUT_MS):
        raise BenchError(f"the echo server did not answer within {REPLY_TIMEOUT_MS} ms")
    sock.recv_multipart()


def latency_client(spec: dict[str, Any], sync: Sync) -> Figures:
    """Concurrency 1: ``requests`` sequential round trips after ``warmup`` untimed ones."""
    frames = submit_sized_message()
    ctx, sock = _dealer(spec["endpoint"])
    try:
        for _ in range(spec["warmup"]):
            _roundtrip(sock, frames)
        sync()
        samples = []
        clock = time.perf_counter_ns
        for _ in range(spec["requests"]):
            t0 = clock()
            _roundtrip(sock, frames)
            samples.append(clock() - t0)
        return {"latency": latency_summary(samples), "errors": 0}
    finally:
        ctx.destroy(linger=0)


def throughput_client(spec: dict[str, Any], sync: Sync) -> Figures:
    """Keep ``in_flight`` messages outstanding; count echoes received in the measured window."""
    frames = submit_sized_message()
    in_flight: int = spec["in_flight"]
    ctx, sock = _dealer(spec["endpoint"])
    try:
        for _ in range(spec["warmup_requests"]):
            _roundtrip(sock, frames)
        sync()
        clock = time.perf_counter
        t0 = clock()
        t_count = t0 + spec["warmup_s"]
        t_end = t_count + spec["duration_s"]
        completed = 0
        outstanding = in_flight
        stuck = 0
        for _ in range(in_flight):
            sock.send_multipart(frames)
        while outstanding:
            if not sock.poll(REPLY_TIMEOUT_MS):
                stuck = outstanding
                break
            sock.recv_multipart()
            now = clock()
            if t_count <= now < t_end:
                completed += 1
            if now < t_end:
                sock.send_multipart(frames)
            else:
                outstanding -= 1
        return {"completed": completed, "errors": stuck, "window_s": spec["duration_s"], "lost": stuck}
    finally:
        ctx.destroy(linger=0)
