"""Engines behind one interface; ``load_engine`` picks one by the model's ``engine`` key."""

from __future__ import annotations

from shmbroker.gpu_worker.engines.base import DeviceContext, DeviceEngine, Engine, EngineError, IOSpec, is_device_engine

GPU_ENGINES = ("torch", "inductor", "tensorrt", "null")


def parse_device(device: str, kind: str) -> int | None:
    """None for "cpu", the ordinal for a GPU index ("0", "1", ...); EngineError for anything else, or for a GPU
    engine asked to run on the CPU (the message names the config key)."""
    if device == "cpu":
        if kind in GPU_ENGINES:
            raise EngineError(
                f"engine {kind!r} runs on a GPU, but this worker's device is 'cpu': "
                f"list GPU indices in worker.devices (e.g. [0]) or use engine 'onnxruntime'"
            )
        return None
    if not device.isdigit():
        raise EngineError(f"device {device!r} is neither 'cpu' nor a GPU index (worker.devices)")
    return int(device)


def load_engine(
    kind: str,
    source: str | bytes,
    *,
    device: str,
    intra_op_threads: int = 0,
    fp16: bool = False,
    cuda_graphs: bool = True,
    max_batch: int = 8,
    null_compute_us: int = 0,
) -> Engine:
    """Build the engine named ``kind`` for a model file (or bytes) on ``device``; EngineError says what failed.

    "onnxruntime" runs on the CPU whatever the device. "torch", "inductor" and "tensorrt" need a GPU device and
    return a DeviceEngine; ``fp16`` applies to "torch" (an inductor package or a plan carries its precision),
    ``cuda_graphs`` to "torch" and "inductor", and ``max_batch`` is checked against the package's largest batch
    or the plan's first optimization profile at load. "null" (benchmarks of the host path) reads only the IO of an
    ONNX file and computes ``null_compute_us`` per batch. A missing package gives an EngineError naming what to
    install.
    """
    if kind == "onnxruntime":
        from shmbroker.gpu_worker.engines.onnxruntime import OnnxRuntimeEngine

        return OnnxRuntimeEngine(source, intra_op_threads=intra_op_threads)
    ordinal = parse_device(device, kind)
    if kind == "torch" and ordinal is not None:
        from shmbroker.gpu_worker.engines.torch import TorchEngine

        return TorchEngine(source, device=ordinal, fp16=fp16, cuda_graphs=cuda_graphs)
    if kind == "inductor" and ordinal is not None:
        from shmbroker.gpu_worker.engines.inductor import InductorEngine

        return InductorEngine(source, device=ordinal, max_batch=max_batch, cuda_graphs=cuda_graphs)
    if kind == "tensorrt" and ordinal is not None:
        from shmbroker.gpu_worker.engines.tensorrt import TensorRTEngine

        return TensorRTEngine(source, device=ordinal, max_batch=max_batch)
    if kind == "null" and ordinal is not None:
        from shmbroker.gpu_worker.engines.null import NullEngine

        return NullEngine(source, device=ordinal, compute_us=null_compute_us, cuda_graphs=cuda_graphs)
    raise EngineError(f"unknown engine {kind!r}: expected one of 'onnxruntime', {', '.join(map(repr, GPU_ENGINES))}")


__all__ = [
    "GPU_ENGINES",
    "DeviceContext",
    "DeviceEngine",
    "Engine",
    "EngineError",
    "IOSpec",
    "is_device_engine",
    "load_engine",
    "parse_device",
]
