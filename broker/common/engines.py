"""The engine table: every engine a model may name in ``models.NAME.engine``, in one place.

Config validation, the worker's ``load_engine``, the set of GPU engines, their error texts and ``shmbroker build
--engine`` all read it. A row names the engine's class by import path, so that reading the table loads no
inference runtime. Adding an engine is one module (a class with ``from_config``, see
``gpu_worker/engines/base.py``) and one row: here for the built-in ones, or an entry point of group
``shmbroker.engines`` whose object is an ``EngineEntry`` (an installed plugin package; docs/ARCHITECTURE.md,
"Add an engine").
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from shmbroker.broker.common.tables import choices, load_target, with_plugins

ENTRY_POINT_GROUP = "shmbroker.engines"


@dataclass(frozen=True)
class EngineEntry:
    """One engine: its name in the config, its class as ``module:Class``, whether it needs a GPU device
    (``worker.devices``), whether ``shmbroker build --engine NAME`` makes its model files, and a line of help."""

    name: str
    target: str
    gpu: bool
    built: bool
    summary: str

    def load_class(self) -> Any:
        """The engine class; ImportError (with the engine named) when its module or class is missing."""
        return load_target(self, "engine")


_E = "shmbroker.gpu_worker.engines"
BUILTIN: tuple[EngineEntry, ...] = (
    EngineEntry("onnxruntime", f"{_E}.onnxruntime:OnnxRuntimeEngine", False, False,
                "ONNX Runtime on the CPU (the embedded default)"),
    EngineEntry("torch", f"{_E}.torch:TorchEngine", True, False,
                "PyTorch eager with CUDA graphs: an ONNX file (through onnx2torch), TorchScript or torch.export"),
    EngineEntry("inductor", f"{_E}.inductor:InductorEngine", True, True,
                "an AOTInductor package (shmbroker build --engine inductor)"),
    EngineEntry("tensorrt", f"{_E}.tensorrt:TensorRTEngine", True, True,
                "a TensorRT plan (shmbroker build --engine tensorrt)"),
    EngineEntry("null", f"{_E}.null:NullEngine", True, False,
                "benchmarks of the host path: an ONNX file's IO, a fixed device time per batch, no model"),
)

@functools.cache
def engine_table() -> dict[str, EngineEntry]:
    """The built-in engines, then those of installed plugins (a plugin cannot replace a built-in one)."""
    return with_plugins(BUILTIN, ENTRY_POINT_GROUP, EngineEntry, "engine")


def gpu_engines() -> tuple[str, ...]:
    """The names of the engines that need a GPU device."""
    return tuple(n for n, e in engine_table().items() if e.gpu)


def built_engines() -> tuple[str, ...]:
    """The engines ``shmbroker build --engine`` makes files for."""
    return tuple(n for n, e in engine_table().items() if e.built)


def choices_text() -> str:
    """The engine names as an error message lists them."""
    return choices(engine_table())
