"""The engine interface that the worker, batcher and pipeline code see; nothing else about an engine leaks."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np


class EngineError(RuntimeError):
    """An engine could not be built or could not run; the text names the model part at fault."""


@dataclass(frozen=True)
class IOSpec:
    """One input or output; ``shape[0]`` is the batch dimension (-1), the rest is fixed."""

    name: str
    dtype: np.dtype[Any]
    shape: tuple[int, ...]
    item_shape: tuple[int, ...] = field(init=False)
    item_bytes: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "item_shape", tuple(self.shape[1:]))
        object.__setattr__(self, "item_bytes", math.prod(self.shape[1:]) * self.dtype.itemsize)


class Engine(Protocol):
    """Runs one batch: ``run`` takes arrays of shape [n, *item_shape] and returns the outputs in order."""

    inputs: list[IOSpec]
    outputs: list[IOSpec]

    def run(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]: ...

    def close(self) -> None: ...


class DeviceContext(Protocol):
    """One stream slot's share of a GPU engine: fixed device buffers for ``max_batch`` rows, one CUDA stream.

    Contract: the pipeline copies rows into ``input_ptrs[k] + row * item_bytes`` on the same stream, calls
    ``enqueue(rows)``, then copies ``output_ptrs[k]`` out, all asynchronously; ``enqueue`` never synchronizes
    the host with the device and never allocates device memory.
    """

    input_ptrs: list[int]  # device address of input k's [max_batch, *item_shape] buffer, in ``inputs`` order
    output_ptrs: list[int]  # likewise for the outputs; valid rows after enqueue(rows) are [0, rows)

    def enqueue(self, rows: int) -> None: ...

    def close(self) -> None: ...


class DeviceEngine(Engine, Protocol):
    """A GPU engine: ``run`` (host arrays, synchronous) for warm-up and tests, contexts for the pipeline."""

    device: int  # the CUDA device ordinal the engine lives on

    def create_context(self, index: int, stream: int, max_batch: int,
                       sizes: Sequence[int] | None = None) -> DeviceContext:
        """The context of stream slot ``index``, bound to the CUDA stream handle ``stream``. ``sizes``: the batch
        sizes to prepare (warm and capture a CUDA graph for) where the engine prepares each size, instead of
        every size up to ``max_batch`` (the bench's sweep); other engines ignore it."""
        ...


def gpu_ordinal(device: int | None, kind: str) -> int:
    """A GPU engine's device ordinal; EngineError naming the config key when the worker's device is the CPU."""
    if device is None:
        raise EngineError(f"engine {kind!r} runs on a GPU, but this worker's device is 'cpu': list GPU indices in "
                          f"worker.devices (e.g. [0]) or use engine 'onnxruntime'")
    return device


def is_device_engine(engine: Engine) -> bool:
    """True for engines the GPU pipeline drives (they have ``create_context``)."""
    return callable(getattr(engine, "create_context", None))
