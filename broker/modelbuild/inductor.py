"""``shmbroker build --engine inductor``: ONNX -> onnx2torch -> torch.export -> AOTInductor (max-autotune and
freezing), one package holding a compiled model per batch bucket (or one with a dynamic batch), and its sidecar.

The buckets are the default: each is exported with static shapes, so autotuning picks kernels for that size
(docs/ARCHITECTURE.md, "The inductor engine", says why). The inductor caches (FX graphs, autotuning results,
Triton kernels) go to ``cache_dir``, so a second build on the same machine reuses them.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import tempfile
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from shmbroker.broker.modelbuild.engine import BuilderMissing, BuildError

log = logging.getLogger(__name__)

PRECISIONS = ("fp32", "fp16")
DEVICE = "cuda"  # where the build compiles for, and so where the package runs
Stage = Callable[[str], AbstractContextManager[None]]


@dataclasses.dataclass(frozen=True)
class InductorOptions:
    """What ``shmbroker build --engine inductor`` compiles: precision, batch sizes and the compiler's settings."""

    precision: str
    batch_sizes: tuple[int, ...]
    dynamic: bool = False  # one model for batches 1..max(batch_sizes) instead of one per size
    autotune: bool = True  # inductor's max-autotune (minutes per size); off: its default kernel choices
    cache_dir: str = ""

    def inductor_configs(self) -> dict[str, Any]:
        return {"aot_inductor.package": True, "max_autotune": self.autotune, "freezing": True}

    def stage_count(self) -> int:
        """Stages of the progress bar: load, then export and compile per model, then package."""
        return 2 + 2 * (1 if self.dynamic else len(self.batch_sizes))


def default_cache_dir() -> str:
    """``$XDG_CACHE_HOME/shmbroker/inductor`` (``~/.cache/...`` when unset)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return str(Path(base) / "shmbroker" / "inductor")


def package_path(out: Path, model: str, precision: str) -> Path:
    """``OUT/<stem>.<precision>.inductor.pt2``; its sidecar is that path plus ``.json``."""
    return out / f"{Path(model).stem}.{precision}.inductor.pt2"


def import_compiler(cache_dir: str) -> Any:
    """``torch`` with CUDA and Triton, its caches pointed at ``cache_dir``; BuilderMissing says what is missing."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir  # read on each cache access, Triton's cache lives inside it
    try:
        import torch
    except ImportError as exc:
        raise BuilderMissing(f"--engine inductor needs PyTorch with CUDA ({exc}): install torch "
                             "(the CUDA build, see pytorch.org) and onnx2torch") from exc
    if not torch.cuda.is_available():
        raise BuilderMissing(f"--engine inductor compiles for a CUDA GPU, and PyTorch {torch.__version__} sees none "
                             "(CUDA_VISIBLE_DEVICES, driver): build on the machine that will serve the package")
    try:
        import triton  # noqa: F401  # inductor's GPU kernels are Triton kernels
    except ImportError as exc:
        raise BuilderMissing(f"--engine inductor needs Triton ({exc}): install the triton that matches "
                             f"torch {torch.__version__}") from exc
    return torch


def _wrapped(torch: Any, module: Any, inputs: list[Any], outputs: list[Any], fp16: bool) -> Any:
    """The module behind casts: it takes and returns the ONNX model's dtypes and computes in half precision
    when ``fp16``, so the casts compile into the first and last kernels."""
    from shmbroker.gpu_worker.engines.graphed import torch_dtype

    feed = [torch.float16 if fp16 and s.dtype.kind == "f" else torch_dtype(s.dtype) for s in inputs]
    back = [torch_dtype(s.dtype) for s in outputs]

    class Cast(torch.nn.Module):  # type: ignore[misc]  # torch is untyped here
        def __init__(self) -> None:
            super().__init__()
            self.inner = module.half() if fp16 else module

        def forward(self, *xs: Any) -> tuple[Any, ...]:
            ys = self.inner(*[x.to(dt) for x, dt in zip(xs, feed, strict=True)])
            ys = [ys] if isinstance(ys, torch.Tensor) else list(ys)
            return tuple(y.to(dt) for y, dt in zip(ys, back, strict=True))

    return Cast().eval()


def _examples(torch: Any, inputs: list[Any], rows: int) -> tuple[Any, ...]:
    from shmbroker.gpu_worker.engines.graphed import torch_dtype

    def one(spec: Any) -> Any:
        dtype = torch_dtype(spec.dtype)
        shape = (rows, *spec.item_shape)
        if dtype.is_floating_point:
            return torch.rand(shape, dtype=dtype, device=DEVICE)
        return torch.zeros(shape, dtype=dtype, device=DEVICE)

    return tuple(one(s) for s in inputs)


def _compile(torch: Any, wrapper: Any, inputs: list[Any], rows: int, options: InductorOptions, label: str,
             stage: Stage) -> list[str]:
    """Export and compile one model; the files that package_aoti takes."""
    example = _examples(torch, inputs, rows)
    dynamic = None
    if options.dynamic:
        batch = torch.export.Dim("batch", min=1, max=rows)
        dynamic = (tuple({0: batch} for _ in inputs),)  # forward(*xs): one entry, the tuple of inputs
    try:
        with stage(f"export {label}"), torch.no_grad():
            program = torch.export.export(wrapper, example, dynamic_shapes=dynamic, strict=False)
        how = "compile with max-autotune" if options.autotune else "compile"
        with stage(f"{how} {label}"), torch.no_grad():
            files = torch._inductor.aot_compile(program.module(), example, options=options.inductor_configs())
    except Exception as exc:  # torch.export and inductor raise many types (UserError, BackendCompilerFailed, ...)
        raise BuildError(f"AOTInductor could not compile {label}: {type(exc).__name__}: {exc}") from exc
    return list(files) if isinstance(files, list | tuple) else [str(files)]


def build_package(onnx_path: str, out: Path, options: InductorOptions, stage: Stage,
                  onnx_sha256: str) -> tuple[Path, dict[str, Any]]:
    """Compile ``onnx_path`` into ``out``'s package on CUDA device 0; returns its path and its sidecar.

    BuilderMissing when torch, CUDA or Triton is missing; BuildError when conversion, export or compilation
    fails (the message names the stage); EngineError (from onnx2torch's load) when the model cannot be read.
    """
    torch = import_compiler(options.cache_dir)
    from torch._inductor.package import package_aoti

    from shmbroker.gpu_worker.engines.inductor import package_meta, runtime_facts
    from shmbroker.gpu_worker.engines.torch import load_onnx

    fp16 = options.precision == "fp16"
    # fp32 means fp32: TF32 off as the engine runs it (inductor bakes the setting into its matmul kernels)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    seconds: dict[str, float] = {}
    t0 = time.monotonic()
    with stage("load ONNX (onnx2torch)"):
        module, inputs, outputs = load_onnx(onnx_path, onnx_path)
        wrapper = _wrapped(torch, module.eval(), inputs, outputs, fp16).to(DEVICE)
    seconds["load"] = round(time.monotonic() - t0, 1)
    sizes = sorted(set(options.batch_sizes))
    plan = [(max(sizes), "dynamic", f"dynamic batch 1..{max(sizes)}")] if options.dynamic else [
        (s, f"batch_{s}", f"batch {s}") for s in sizes]
    files: dict[str, list[str]] = {}
    for rows, name, label in plan:
        t0 = time.monotonic()
        files[name] = _compile(torch, wrapper, inputs, rows, options, label, stage)
        seconds[name] = round(time.monotonic() - t0, 1)
    path = package_path(out, onnx_path, options.precision)
    t0 = time.monotonic()
    with stage("package"):
        # written beside and renamed: a failed build never leaves a half-written package under the final name
        fd, tmp = tempfile.mkstemp(dir=out, suffix=".pt2")
        os.close(fd)
        try:
            package_aoti(tmp, files)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    seconds["package"] = round(time.monotonic() - t0, 1)
    io = {k: [{"name": s.name, "dtype": s.dtype.name, "shape": list(s.shape)} for s in specs]
          for k, specs in (("inputs", inputs), ("outputs", outputs))}
    meta = package_meta(facts=runtime_facts(0), precision=options.precision, sizes=sizes, dynamic=options.dynamic,
                        io=io, onnx_name=Path(onnx_path).name, onnx_sha256=onnx_sha256,
                        options={**options.inductor_configs(), "cache_dir": options.cache_dir}, seconds=seconds)
    return path, meta
