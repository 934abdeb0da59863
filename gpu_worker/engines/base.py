"""The engine interface that the worker, batcher and pipeline code see; nothing else about an engine leaks."""

from __future__ import annotations

import math
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
