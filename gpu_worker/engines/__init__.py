"""Engines behind one interface; ``load_engine`` builds the one a model names, from the engine table
(``broker/common/engines.py``)."""

from __future__ import annotations

from typing import Any

from shmbroker.broker.common.config import ModelSection
from shmbroker.broker.common.engines import choices_text, engine_table, gpu_engines
from shmbroker.gpu_worker.engines.base import (
    DeviceContext,
    DeviceEngine,
    Engine,
    EngineError,
    IOSpec,
    gpu_ordinal,
    is_device_engine,
)


def parse_device(device: str, kind: str) -> int | None:
    """None for "cpu", the ordinal for a GPU index ("0", "1", ...); EngineError for anything else, or for a GPU
    engine asked to run on the CPU (the message names the config key)."""
    if device == "cpu":
        if kind in gpu_engines():
            gpu_ordinal(None, kind)
        return None
    if not device.isdigit():
        raise EngineError(f"device {device!r} is neither 'cpu' nor a GPU index (worker.devices)")
    return int(device)


def load_engine(kind: str, source: str | bytes, *, device: str, model: ModelSection | None = None,
                **keys: Any) -> Engine:
    """Build the engine named ``kind`` for a model file (or bytes) on ``device``; EngineError says what failed.

    The engine reads its own keys from ``model`` (the model's config section), or from a section of ``keys``
    (``fp16=True``, ``max_batch=8``, ...) where none is given. A GPU engine on "cpu", an unknown name, or a
    missing package (the message names what to install) is an EngineError.
    """
    entry = engine_table().get(kind)
    if entry is None:
        raise EngineError(f"unknown engine {kind!r}: expected one of {choices_text()}")
    ordinal = parse_device(device, kind)
    section = model if model is not None else ModelSection(path=source if isinstance(source, str) else "",
                                                           engine=kind, **keys)
    try:
        cls = entry.load_class()
    except ImportError as exc:
        raise EngineError(f"engine {kind!r} cannot be imported: {exc}") from exc
    engine: Engine = cls.from_config(source, device=None if not entry.gpu else ordinal, model=section)
    return engine


__all__ = [
    "DeviceContext",
    "DeviceEngine",
    "Engine",
    "EngineError",
    "IOSpec",
    "is_device_engine",
    "load_engine",
    "parse_device",
]
