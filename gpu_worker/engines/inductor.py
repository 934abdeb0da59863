"""AOTInductor packages on a GPU: the ahead-of-time compiled engine that ``shmbroker build --engine inductor``
writes. Loading runs no compiler: the package holds the compiled kernels and the wrapper library.

A package (``<stem>.<precision>.inductor.pt2``) holds one compiled model per batch bucket (static shapes,
each autotuned for its size) or one model with a dynamic batch; its sidecar ``<package>.json`` (see
``package_meta``) says which, with the IO, the precision and the versions it was built with. A package built
with another PyTorch, CUDA or GPU generation is refused before loading, with both sides named. The model
computes in its own precision and casts inside: clients send and receive the ONNX model's dtypes either way.
Each stream slot loads its own copy of the models (``run_single_threaded``: no lock, so a CUDA graph can
capture a run) and replays one CUDA graph per bucket.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import re
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from shmbroker.gpu_worker.engines.base import EngineError, gpu_ordinal
from shmbroker.gpu_worker.engines.graphed import Body, GraphedContext, as_list, graph_ladder, torch_dtype, torch_module
from shmbroker.gpu_worker.engines.meta import read_sidecar, specs_from_json

if TYPE_CHECKING:
    from shmbroker.broker.common.config import ModelSection

log = logging.getLogger(__name__)

FORMAT = "shmbroker-inductor/1"
REBUILD = "rebuild it on this machine (shmbroker build --engine inductor)"
CXX_RUNTIME = "libstdc++.so.6"


def runtime_facts(device: int) -> dict[str, str]:
    """What a package must match on this machine: PyTorch, CUDA and Triton versions, the GPU and its generation."""
    torch = torch_module()
    try:
        import triton

        triton_version = str(triton.__version__)
    except ImportError:
        triton_version = ""
    major, minor = torch.cuda.get_device_capability(device)
    return {"torch_version": str(torch.__version__), "cuda_version": str(torch.version.cuda or ""),
            "triton_version": triton_version, "gpu_name": str(torch.cuda.get_device_name(device)),
            "compute_capability": f"{major}.{minor}"}


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version.split("+", maxsplit=1)[0])[:3])


def check_package_meta(meta: dict[str, Any], *, where: str, facts: dict[str, str]) -> None:
    """Refuse, before loading, a package built for another machine; the message names the field and both sides.

    The same PyTorch release (the wrapper library is built against its ABI), the same CUDA major version and
    the same compute capability (the kernels are compiled for one); another GPU name of that generation, or
    another Triton, is only logged.
    """
    if meta.get("format") != FORMAT:
        raise EngineError(f"sidecar of {where}: field 'format' is {meta.get('format')!r}, expected {FORMAT!r}: "
                          f"{REBUILD}")
    checks = (("torch_version", "PyTorch", 3), ("cuda_version", "CUDA", 1),
              ("compute_capability", "compute capability", 2))  # the leading numbers that must agree
    for field, what, parts in checks:
        theirs, ours = str(meta.get(field, "")), facts[field]
        if _release(theirs)[:parts] != _release(ours)[:parts]:
            built_for = f" on {meta['gpu_name']}" if field == "compute_capability" and meta.get("gpu_name") else ""
            raise EngineError(
                f"{where} was built with {what} {theirs or '(none recorded)'}{built_for}; this worker has {what} "
                f"{ours} on {facts['gpu_name']} (sidecar field {field}): {REBUILD}"
            )
    for field in ("gpu_name", "triton_version"):
        if meta.get(field) and meta[field] != facts[field]:
            log.warning("%s was built with %s %s, runs with %s", where, field, meta[field], facts[field])


def package_meta(*, facts: dict[str, str], precision: str, sizes: Sequence[int], dynamic: bool,
                 io: dict[str, list[dict[str, Any]]], onnx_name: str, onnx_sha256: str,
                 options: dict[str, Any], seconds: dict[str, float]) -> dict[str, Any]:
    """The sidecar ``<package>.json`` that ``shmbroker build`` writes and InductorEngine checks.

    ``batch``: mode "buckets" with one model per size ({size: "batch_<size>"}), or mode "dynamic" with one
    model ({largest size: "dynamic"}) that runs any batch up to it. ``io`` holds ``inputs`` and ``outputs``
    lists of {name, dtype, shape}; ``options`` the inductor settings; ``seconds`` the time of each stage.
    """
    models = {str(max(sizes)): "dynamic"} if dynamic else {str(s): f"batch_{s}" for s in sorted(sizes)}
    return {"format": FORMAT, **facts, "precision": precision,
            "batch": {"mode": "dynamic" if dynamic else "buckets", "models": models},
            "inputs": io["inputs"], "outputs": io["outputs"], "onnx": onnx_name, "onnx_sha256": onnx_sha256,
            "inductor": options, "build_seconds": seconds}


def _batch_plan(meta: dict[str, Any], where: str) -> tuple[str, dict[int, str]]:
    """(mode, {size: model name}) from the sidecar's ``batch`` field; EngineError names what is wrong."""
    batch = meta.get("batch")
    try:
        mode = str(batch["mode"])  # type: ignore[index]
        models = {int(size): str(name) for size, name in batch["models"].items()}  # type: ignore[index]
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise EngineError(f"sidecar of {where}: field 'batch' needs 'mode' and 'models' {{size: name}}: "
                          f"{REBUILD}") from exc
    if mode not in ("buckets", "dynamic") or not models or min(models) < 1 or (mode == "dynamic" and len(models) > 1):
        raise EngineError(f"sidecar of {where}: field 'batch' has mode {mode!r} with sizes {sorted(models)}: {REBUILD}")
    return mode, models


@functools.cache
def share_cxx_runtime() -> None:
    """Put the process's ``libstdc++.so.6`` in the global symbol scope, once, before a package loads.

    A wrapper library linked against a static C++ runtime (the linker takes a ``libstdc++.a`` from its search
    path when it finds no ``libstdc++.so``) exports that copy; ``import torch`` loads ``libstdc++.so.6`` outside
    the global scope, so the wrapper binds most of the runtime to its own copy but the GNU-unique symbols (the
    locale facet ids) to the process's, and its ``std::regex`` crashes. With the process's runtime global, the
    locale and the rest bind to it (bench/RESULTS.md#inductor-packages-on-the-2026-12-05-machine).
    """
    try:
        ctypes.CDLL(CXX_RUNTIME, mode=os.RTLD_GLOBAL)  # the soname: the copy that torch loaded
    except OSError as exc:  # no shared C++ runtime: a wrapper can only carry its own, and nothing mixes
        log.debug("no shared C++ runtime to share (%s): %s", CXX_RUNTIME, exc)


class InductorEngine:
    """An AOTInductor package on CUDA device ``device``; a DeviceEngine (see base.py) and a GraphedEngine."""

    @classmethod
    def from_config(cls, source: str | bytes, *, device: int | None, model: ModelSection) -> InductorEngine:
        """The table's constructor: reads ``max_batch`` (checked against the package) and ``cuda_graphs``."""
        return cls(source, device=gpu_ordinal(device, "inductor"), max_batch=model.max_batch,
                   cuda_graphs=model.cuda_graphs)

    def __init__(self, source: str | bytes, *, device: int, max_batch: int = 0, cuda_graphs: bool = True) -> None:
        if isinstance(source, bytes) or not source.endswith(".pt2"):
            raise EngineError(f"engine 'inductor' loads a .pt2 package written by shmbroker build, not {source!r}")
        torch = torch_module()
        if not torch.cuda.is_available() or device >= torch.cuda.device_count():
            raise EngineError(f"engine 'inductor': PyTorch sees no CUDA device {device} (worker.devices)")
        meta = read_sidecar(source)
        if meta is None:
            raise EngineError(f"package {source} has no sidecar {source}.json: {REBUILD}")
        check_package_meta(meta, where=source, facts=runtime_facts(device))
        self.inputs = specs_from_json(meta.get("inputs"), "input", f"sidecar of {source}")
        self.outputs = specs_from_json(meta.get("outputs"), "output", f"sidecar of {source}")
        self.mode, self._models = _batch_plan(meta, source)
        self.precision = str(meta.get("precision", ""))
        self.largest = max(self._models)
        if max_batch > self.largest:
            raise EngineError(
                f"package {source} runs batches up to {self.largest}; the model's max_batch is {max_batch}: rebuild "
                f"with --batch-sizes up to {max_batch}, or lower max_batch"
            )
        # TF32 off as in the torch engine: the kernels that fall back to cuBLAS/cuDNN read these at run time
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        self.source = source
        self.device = device
        self.cuda_graphs = cuda_graphs
        self.graphs_failed: str | None = None
        self._create_lock = threading.Lock()
        self._run_models = self._load()
        self._run_lock = threading.Lock()

    def _load(self) -> dict[int, Any]:
        """A fresh copy of every model of the package on this engine's device, without locks: PyTorch's package
        loader itself, not ``load_pt2``, whose device-information check compiles and loads a test library per
        CPU vector ISA (tens of seconds) to compare fields that the sidecar check already covers."""
        share_cxx_runtime()
        loader = torch_module()._C._aoti.AOTIModelPackageLoader
        loaded = {}
        for size, name in self._models.items():
            try:
                loaded[size] = loader(self.source, name, True, 1, self.device)  # run_single_threaded, 1 runner
            except (RuntimeError, OSError, ValueError) as exc:
                raise EngineError(f"PyTorch cannot load model {name!r} of the package {self.source}: {exc}: "
                                  f"{REBUILD}") from exc
        return loaded

    def size_for(self, rows: int) -> int:
        """The dynamic model runs any count; buckets run the smallest bucket holding ``rows``."""
        if self.mode == "dynamic":
            return rows
        return min(s for s in self._models if s >= rows)

    def prepared_sizes(self, max_batch: int, wanted: Sequence[int] | None) -> list[int]:
        """Dynamic: ``graph_ladder(max_batch)`` (or ``wanted``); buckets: those that some count maps to."""
        if self.mode == "dynamic":
            return sorted(set(wanted)) if wanted else graph_ladder(max_batch)
        counts = sorted(set(wanted)) if wanted else list(range(1, max_batch + 1))
        return sorted({self.size_for(rows) for rows in counts})

    def _body(self, models: dict[int, Any]) -> Body:
        count = len(self.outputs)
        dynamic = self.mode == "dynamic"
        only = next(iter(models.values()))

        def body(inputs: list[Any], size: int) -> list[Any]:
            model = only if dynamic else models[size]
            return as_list(model.boxed_run([t[:size] for t in inputs]), count)  # flat tensors in, flat out

        return body

    def bind(self, index: int) -> Body:
        """Stream slot ``index`` runs its own copy of the models: unlocked runs never share a container."""
        return self._body(self._load())

    def create_context(self, index: int, stream: int, max_batch: int,
                       sizes: Sequence[int] | None = None) -> GraphedContext:
        """Stream slot ``index``: buffers for the bucket that holds ``max_batch``, warm, one graph per bucket."""
        if max_batch > self.largest:
            raise EngineError(f"package {self.source} runs batches up to {self.largest}, slot {index} asks {max_batch}")
        with self._create_lock:
            return GraphedContext(self, index, stream, max_batch, sizes)

    def run(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        """Host arrays in, host arrays out, on the current stream; synchronous (warm-up, tests, check-precision).
        Batches larger than the largest bucket run in parts."""
        torch = torch_module()
        rows = int(next(iter(feeds.values())).shape[0])
        body = self._body(self._run_models)
        parts: list[list[np.ndarray]] = []
        with self._run_lock, torch.inference_mode(), torch.cuda.device(self.device):
            for lo in range(0, rows, self.largest):
                n = min(self.largest, rows - lo)
                size = self.size_for(n)
                tensors = []
                for s in self.inputs:  # a bucket's worth of rows, the ones past n zero
                    t = torch.zeros((size, *s.item_shape), dtype=torch_dtype(s.dtype), device=f"cuda:{self.device}")
                    t[:n].copy_(torch.from_numpy(np.ascontiguousarray(feeds[s.name][lo : lo + n], dtype=s.dtype)))
                    tensors.append(t)
                outs = body(tensors, size)
                parts.append([o[:n].cpu().numpy().astype(s.dtype, copy=False)
                              for o, s in zip(outs, self.outputs, strict=True)])
        return [np.concatenate([p[k] for p in parts]) for k in range(len(self.outputs))]

    def close(self) -> None:
        self._run_models.clear()
        torch_module().cuda.empty_cache()
