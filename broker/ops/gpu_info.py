"""GPU utilization and memory through NVML (nvidia-ml-py), only where it is importable and a GPU is present."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

_lock = threading.Lock()
_nvml: Any = None  # the pynvml module once nvmlInit succeeded; False once it failed (not retried)


@dataclass(frozen=True)
class GpuSample:
    index: int
    utilization: float  # 0..1
    memory_used: int  # bytes
    memory_total: int


def _init() -> Any:
    global _nvml
    with _lock:
        if _nvml is None:
            try:
                import pynvml

                pynvml.nvmlInit()
                _nvml = pynvml
            except Exception as exc:  # noqa: BLE001 - no module, no driver, no GPU: all mean "no GPU metrics"
                log.debug("no GPU metrics: %s", exc)
                _nvml = False
        return _nvml or None


def gpu_samples(indices: list[int]) -> list[GpuSample]:
    """One sample per GPU ordinal in ``indices``; an empty list without NVML or for a GPU it cannot read."""
    if not indices:
        return []
    nvml = _init()
    if nvml is None:
        return []
    out = []
    for i in indices:
        try:
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            util = nvml.nvmlDeviceGetUtilizationRates(h)
            mem = nvml.nvmlDeviceGetMemoryInfo(h)
        except nvml.NVMLError as exc:
            log.debug("GPU %d: %s", i, exc)
            continue
        out.append(GpuSample(i, util.gpu / 100.0, int(mem.used), int(mem.total)))
    return out
