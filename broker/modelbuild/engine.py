"""The TensorRT engine build (TensorRT 10/11 API) and the plan's metadata sidecar that the worker checks.

Precision is already in the ONNX graph (converted types, Q/DQ nodes); the network is strongly typed (TensorRT
11's only mode, asked for explicitly on 10), so no FP16/INT8 builder flags. One optimization profile per stream
slot (each concurrent execution context needs its own), a timing cache that is read and written back, and
optionally a version-compatible and/or Ampere+-hardware-compatible plan. This path cannot run without the full
TensorRT builder and a GPU, and is not covered by tests; the sidecar it writes is (``make_sidecar``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

INSTALL_HINT = ("install the full builder from NVIDIA's index: "
                "pip install tensorrt-cu13 --extra-index-url https://pypi.nvidia.com")

Shape = tuple[int, ...]


class BuilderMissing(RuntimeError):
    """The full TensorRT builder is not importable (only the lean runtime, or nothing)."""


class BuildError(RuntimeError):
    """TensorRT refused the model or the build; the message carries TensorRT's own reasons."""


@dataclasses.dataclass(frozen=True)
class BuildOptions:
    """What ``shmbroker build`` passes to the builder; ``shapes`` maps each input to its (min, opt, max)."""

    shapes: dict[str, tuple[Shape, Shape, Shape]]
    streams: int = 1
    workspace_mib: int = 1024
    timing_cache: str = ""
    version_compatible: bool = False
    hardware_compat: str = "none"

    def flags(self) -> list[str]:
        """The build flags as the sidecar records them (the worker's check_plan_meta reads these words)."""
        found = ["STRONGLY_TYPED"]
        if self.version_compatible:
            found.append("VERSION_COMPATIBLE")
        if self.hardware_compat == "ampere+":
            found.append("HARDWARE_COMPATIBILITY_AMPERE_PLUS")
        return found


def import_builder() -> Any:
    """The ``tensorrt`` module with its Builder; BuilderMissing says what is missing and how to install it."""
    try:
        trt = importlib.import_module("tensorrt")
    except ImportError as exc:
        raise BuilderMissing(f"the full TensorRT builder is not installed ({exc}): {INSTALL_HINT}") from exc
    if not hasattr(trt, "Builder"):
        raise BuilderMissing(f"module 'tensorrt' has no Builder (a runtime-only install): {INSTALL_HINT}")
    return trt


def sha256(path: str) -> str:
    """Hex SHA-256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def make_sidecar(
    *, onnx_path: str, source_sha256: str, precision: str, options: BuildOptions, io: dict[str, list[dict[str, Any]]],
    tensorrt_version: str, gpu_name: str, capability: tuple[int, int],
) -> dict[str, Any]:
    """The sidecar ``<plan>.json`` as gpu_worker.engines.meta documents it and TensorRTEngine checks it.

    ``io`` holds ``inputs`` and ``outputs`` lists of {name, dtype, shape}; ``profiles`` is one entry per stream
    slot mapping each input to its min/opt/max shapes.
    """
    profile = {name: {"min": list(s[0]), "opt": list(s[1]), "max": list(s[2])} for name, s in options.shapes.items()}
    return {
        "tensorrt_version": tensorrt_version,
        "gpu_name": gpu_name,
        "compute_capability": f"{capability[0]}.{capability[1]}",
        "precision": precision,
        "profiles": [profile for _ in range(options.streams)],
        "inputs": io["inputs"],
        "outputs": io["outputs"],
        "onnx_sha256": source_sha256,
        "onnx": Path(onnx_path).name,
        "flags": options.flags(),
    }


def _network_flags(trt: Any) -> int:
    # TensorRT 11 builds strongly typed networks only (flag 0); 10 needs STRONGLY_TYPED to take the graph's types
    major = int(str(trt.__version__).split(".")[0])
    strongly = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
    return 1 << int(strongly) if major < 11 and strongly is not None else 0


def _monitor(trt: Any, advance: Callable[[str, int, int], None]) -> Any:
    class Monitor(trt.IProgressMonitor):  # type: ignore[misc]  # the base comes from the untyped bindings
        """Forwards the builder's phases and steps to ``advance(phase, step, steps)``; never cancels."""

        def __init__(self) -> None:
            trt.IProgressMonitor.__init__(self)
            self._steps: dict[str, int] = {}

        def phase_start(self, phase_name: str, parent_phase: str | None, num_steps: int) -> None:
            self._steps[phase_name] = num_steps
            advance(phase_name, 0, num_steps)

        def step_complete(self, phase_name: str, step: int) -> bool:
            advance(phase_name, step + 1, self._steps.get(phase_name, step + 1))
            return True

        def phase_finish(self, phase_name: str) -> None:
            self._steps.pop(phase_name, None)

    return Monitor()


def _configure(trt: Any, builder: Any, options: BuildOptions) -> tuple[Any, Any]:
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, options.workspace_mib << 20)
    for _ in range(options.streams):  # one profile per stream slot: contexts that run at once need their own
        profile = builder.create_optimization_profile()
        for name, (low, opt, high) in options.shapes.items():
            profile.set_shape(name, low, opt, high)
        config.add_optimization_profile(profile)
    cache_path = Path(options.timing_cache) if options.timing_cache else None
    cache = config.create_timing_cache(cache_path.read_bytes() if cache_path and cache_path.exists() else b"")
    config.set_timing_cache(cache, ignore_mismatch=False)
    if options.version_compatible:
        config.set_flag(trt.BuilderFlag.VERSION_COMPATIBLE)
    if options.hardware_compat == "ampere+":
        config.hardware_compatibility_level = trt.HardwareCompatibilityLevel.AMPERE_PLUS
    return config, cache_path


def build_plan(trt: Any, onnx_path: str, plan_path: str, options: BuildOptions,
               advance: Callable[[str, int, int], None] | None = None) -> tuple[str, tuple[int, int], str]:
    """Build ``onnx_path`` into a serialized plan at ``plan_path`` on CUDA device 0.

    Returns (TensorRT version, compute capability, GPU name) for the sidecar. BuildError carries TensorRT's
    parser errors or logged reasons; the timing cache file, when given, is written back after the build.
    """
    from shmbroker.gpu_worker import cuda
    from shmbroker.gpu_worker.engines.tensorrt import shared_logger

    try:
        gpu, capability = cuda.device_name(0), cuda.compute_capability(0)
    except cuda.CudaError as exc:
        raise BuildError(f"a TensorRT build needs a CUDA GPU: {exc}") from exc
    logger = shared_logger(trt)
    builder = trt.Builder(logger)
    network = builder.create_network(_network_flags(trt))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(onnx_path):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise BuildError(f"TensorRT's ONNX parser refused {onnx_path}: {errors}")
    config, cache_path = _configure(trt, builder, options)
    if advance is not None and hasattr(trt, "IProgressMonitor"):
        config.progress_monitor = _monitor(trt, advance)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise BuildError(f"TensorRT could not build {onnx_path}: {logger.take()}")
    Path(plan_path).write_bytes(bytes(plan))
    if cache_path is not None:
        cache_path.write_bytes(bytes(config.get_timing_cache().serialize()))
    log.info("plan written to %s (TensorRT %s, %s)", plan_path, trt.__version__, gpu)
    return str(trt.__version__), capability, gpu
