"""Engines behind one interface; ``load_engine`` picks one by the model's ``engine`` key."""

from __future__ import annotations

from gpu_worker.engines.base import Engine, EngineError, IOSpec


def load_engine(kind: str, source: str | bytes, *, device: str, intra_op_threads: int = 0) -> Engine:
    """Build the engine named ``kind`` for a model file (or bytes); EngineError says what failed."""
    if kind == "onnxruntime":
        from gpu_worker.engines.onnxruntime import OnnxRuntimeEngine

        return OnnxRuntimeEngine(source, intra_op_threads=intra_op_threads)
    raise EngineError(f"engine {kind!r} is not available in this build (the GPU engines come with issue 3)")


__all__ = ["Engine", "EngineError", "IOSpec", "load_engine"]
