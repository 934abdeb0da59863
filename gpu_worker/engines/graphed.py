"""One stream slot of an engine that PyTorch runs (eager modules, AOTInductor packages): fixed device buffers,
a warm allocator and one CUDA graph per prepared batch size, replayed on the pipeline's own CUDA stream."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from shmbroker.gpu_worker.engines.base import EngineError, IOSpec

log = logging.getLogger(__name__)

_torch_mod: Any = None

Body = Callable[[list[Any], int], list[Any]]  # (device input tensors, rows) -> the raw output tensors, no sync


def torch_module() -> Any:
    """The ``torch`` module, imported once; EngineError says what to install when it is missing."""
    global _torch_mod
    if _torch_mod is None:
        try:
            import torch
        except ImportError as exc:
            raise EngineError(
                "engines 'torch', 'inductor' and 'null' need PyTorch with CUDA: install torch (the CUDA build, see "
                "pytorch.org)"
            ) from exc
        _torch_mod = torch
    return _torch_mod


def torch_dtype(dtype: np.dtype[Any]) -> Any:
    """The torch dtype of a numpy dtype."""
    return torch_module().from_numpy(np.empty(0, dtype=dtype)).dtype


def as_list(result: Any, count: int) -> list[Any]:
    """A module's result as a list of ``count`` tensors; EngineError when the count differs."""
    outs = [result] if isinstance(result, torch_module().Tensor) else list(result)
    if len(outs) != count:
        raise EngineError(f"the module returned {len(outs)} outputs, the model declares {count}")
    return outs


class GraphedEngine(Protocol):
    """What a GraphedContext needs of its engine."""

    device: int
    inputs: list[IOSpec]
    outputs: list[IOSpec]
    cuda_graphs: bool
    graphs_failed: str | None  # why capture failed once; later contexts then skip it

    def bind(self, index: int) -> Body:
        """The body stream slot ``index`` runs; an engine may give each slot its own loaded model."""
        ...

    def prepared_sizes(self, max_batch: int, wanted: Sequence[int] | None) -> list[int]:
        """The batch sizes a slot warms and captures, the largest covering ``max_batch`` (and ``wanted``); a batch
        runs in the smallest of them that holds its rows."""
        ...


def graph_ladder(max_batch: int) -> list[int]:
    """Sizes to capture for a model that runs any batch (eager, or a dynamic package): 1 to 8, then four even
    steps per doubling (10, 12, 14, 16, 20, ...), and ``max_batch``; a batch pads to the next size, at most a
    quarter more rows.

    Why not every size: each captured graph keeps its own memory, about 190 MB per size for open-nsfw, so
    256 sizes on 4 stream slots do not fit an H200 (bench/RESULTS.md#graph-sizes).
    """
    sizes = set(range(1, 9))
    base = 8
    while base < max_batch:
        sizes.update(base + base // 4 * i for i in range(1, 5))
        base *= 2
    return sorted({s for s in sizes if s < max_batch} | {max_batch})


class GraphedContext:
    """One stream slot (a DeviceContext): device buffers of the largest prepared size, graphs keyed by size.

    The CUDA stream belongs to the caller, who keeps it alive longer than the context. ``enqueue`` of one
    context is not reentrant (one slot, one thread at a time); different contexts may enqueue concurrently.
    Rows past ``rows`` of a bucket hold stale inputs; their outputs are computed and never read.
    """

    def __init__(self, engine: GraphedEngine, index: int, stream: int, max_batch: int,
                 sizes: Sequence[int] | None = None) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        torch = torch_module()
        self._torch = torch
        self._engine = engine
        self.index = index
        self.max_batch = max_batch
        self._sizes = engine.prepared_sizes(max_batch, sizes)
        self._size_of = {rows: min(s for s in self._sizes if s >= rows) for rows in range(1, max_batch + 1)}
        self._body_fn = engine.bind(index)
        dev = torch.device("cuda", engine.device)
        self._stream = torch.cuda.ExternalStream(stream, device=dev)
        rows = max(self._sizes)
        with torch.cuda.stream(self._stream):
            self._inputs = [torch.zeros((rows, *s.item_shape), dtype=torch_dtype(s.dtype), device=dev)
                            for s in engine.inputs]
            self._outputs = [torch.zeros((rows, *s.item_shape), dtype=torch_dtype(s.dtype), device=dev)
                             for s in engine.outputs]
        self.input_ptrs = [int(t.data_ptr()) for t in self._inputs]
        self.output_ptrs = [int(t.data_ptr()) for t in self._outputs]
        self._graphs: dict[int, Any] = {}
        self._warm_up()
        if engine.cuda_graphs and engine.graphs_failed is None:
            self._capture()
        self._stream.synchronize()

    @property
    def graph_sizes(self) -> list[int]:
        """The batch sizes that replay a CUDA graph (empty when running eagerly)."""
        return sorted(self._graphs)

    @property
    def sizes(self) -> list[int]:
        """The batch sizes this slot runs: every row count maps to the smallest of these that holds it."""
        return list(self._sizes)

    def _body(self, size: int, check: bool = False) -> None:
        outs = self._body_fn(self._inputs, size)
        for dst, src, spec in zip(self._outputs, outs, self._engine.outputs, strict=True):
            if check and tuple(src.shape) != (size, *spec.item_shape):
                raise EngineError(
                    f"output {spec.name!r} came back {list(src.shape)} for {size} rows, "
                    f"declared {[size, *spec.item_shape]}"
                )
            dst[:size].copy_(src)  # casts to the declared dtype where the module computes in another

    def _warm_up(self) -> None:
        # every size once, on this stream: the caching allocator then holds what each size needs, so the
        # request path allocates nothing new, and cuDNN/cuBLAS state and loaded kernels exist before capture
        torch = self._torch
        with torch.inference_mode(), torch.cuda.stream(self._stream):
            for size in self._sizes:
                self._body(size, check=True)

    def _capture(self) -> None:
        torch = self._torch
        engine = self._engine
        pool = torch.cuda.graph_pool_handle()  # one pool per context: its graphs only ever run in turn
        graphs: dict[int, Any] = {}
        try:
            for size in self._sizes:
                graph = torch.cuda.CUDAGraph()
                with (
                    torch.inference_mode(),
                    torch.cuda.graph(graph, pool=pool, stream=self._stream, capture_error_mode="thread_local"),
                ):
                    self._body(size)
                graphs[size] = graph
        except RuntimeError as exc:  # how torch reports a capture fault (a host sync, an uncapturable op)
            engine.graphs_failed = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            log.warning("cuda:%d: CUDA graph capture failed, running eagerly: %s", engine.device, engine.graphs_failed)
            torch.cuda.synchronize(engine.device)
            self._warm_up()  # capture emptied the allocator's cache; refill it for the eager path
            return
        self._graphs = graphs

    def enqueue(self, rows: int) -> None:
        """Run rows [0, rows) of the input buffers into the output buffers, on this context's stream.

        Asynchronous: no host sync, and no device allocation beyond what warm-up left in the allocator.
        """
        size = self._size_of.get(rows)
        if size is None:
            raise ValueError(f"rows must be in [1, {self.max_batch}], got {rows}")
        torch = self._torch
        graph = self._graphs.get(size)
        with torch.cuda.stream(self._stream):
            if graph is not None:
                graph.replay()
            else:
                with torch.inference_mode():
                    self._body(size)

    def close(self) -> None:
        self._graphs.clear()
        self._inputs.clear()
        self._outputs.clear()
