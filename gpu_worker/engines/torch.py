"""PyTorch on a GPU: an ONNX file through onnx2torch, a TorchScript file or an ExportedProgram, run on the
pipeline's own CUDA streams, in fp32 (TF32 off) or fp16, with one CUDA graph per batch size.

Sources: ``.onnx`` (or model bytes) via onnx2torch; ``.pt``/``.ts``/``.pth``/``.torchscript`` via
``torch.jit.load`` (IO declared in the sidecar ``<file>.json``, see ``engines/meta.py``); ``.pt2`` via
``torch.export.load`` (IO read from the program, or from a sidecar when present).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import numpy as np

from gpu_worker.engines.base import EngineError, IOSpec
from gpu_worker.engines.meta import read_sidecar, spec_from_dims, specs_from_json

log = logging.getLogger(__name__)

_TORCHSCRIPT = (".pt", ".ts", ".pth", ".torchscript")
_EXPORTED = (".pt2",)
_torch_mod: Any = None


def _torch() -> Any:
    global _torch_mod
    if _torch_mod is None:
        try:
            import torch
        except ImportError as exc:
            raise EngineError(
                "engine 'torch' needs PyTorch with CUDA: install torch (the CUDA build, see pytorch.org)"
            ) from exc
        _torch_mod = torch
    return _torch_mod


def _torch_dtype(dtype: np.dtype[Any]) -> Any:
    return _torch().from_numpy(np.empty(0, dtype=dtype)).dtype


def _numpy_dtype(torch_dtype: Any, what: str) -> np.dtype[Any]:
    try:
        dtype: np.dtype[Any] = np.dtype(_torch().empty(0, dtype=torch_dtype).numpy().dtype)
    except TypeError as exc:  # bfloat16 and the float8 types have no numpy twin
        raise EngineError(f"{what} has dtype {torch_dtype}, which shmbroker does not carry") from exc
    return dtype


def _reshape_static(x: Any, dims: tuple[int, ...]) -> Any:
    """ONNX Reshape with a constant target shape, on host integers only: nothing reads the device, so a
    CUDA graph can capture it (onnx2torch's own Reshape tests ``torch.any(shape == 0)`` on the device)."""
    if 0 in dims:
        dims = tuple(x.shape[i] if d == 0 else d for i, d in enumerate(dims))
    return x.reshape(dims)


def _constant(gm: Any, arg: Any) -> Any:
    """The tensor an FX argument always holds (an initializer or an ONNX Constant), else None."""
    from onnx2torch.node_converters.constant import OnnxConstant

    torch = _torch()
    if not isinstance(arg, torch.fx.Node):
        return None
    if arg.op == "get_attr":
        value: Any = gm
        for part in str(arg.target).split("."):
            value = getattr(value, part)
        return value if isinstance(value, torch.Tensor) else None
    if arg.op == "call_module":
        module = gm.get_submodule(str(arg.target))
        if isinstance(module, OnnxConstant) and isinstance(module.value, torch.Tensor):
            return module.value
    return None


def fold_constant_reshapes(gm: Any) -> tuple[int, int]:
    """Replace onnx2torch Reshapes whose shape is a constant by ``_reshape_static``; (folded, left as they were)."""
    from onnx2torch.node_converters.reshape import OnnxReshape

    folded = left = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_module" or not isinstance(gm.get_submodule(str(node.target)), OnnxReshape):
            continue
        shape = _constant(gm, node.args[1]) if len(node.args) == 2 and not node.kwargs else None
        if shape is None:
            left += 1
            continue
        dims = tuple(int(d) for d in shape.reshape(-1).tolist())
        with gm.graph.inserting_before(node):
            static = gm.graph.call_function(_reshape_static, (node.args[0], dims))
        node.replace_all_uses_with(static)
        gm.graph.erase_node(node)
        folded += 1
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return folded, left


def _onnx_specs(model: Any) -> tuple[list[IOSpec], list[IOSpec]]:
    import onnx

    def spec(value: Any, role: str) -> IOSpec:
        ttype = value.type.tensor_type
        try:
            dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(ttype.elem_type))
        except (KeyError, TypeError, ValueError) as exc:
            raise EngineError(f"{role} {value.name!r} is not a tensor of a numpy type") from exc
        dims = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in ttype.shape.dim]
        return spec_from_dims(value.name, dtype, dims, role)

    initializers = {t.name for t in model.graph.initializer}  # IR < 4 lists them as inputs too
    inputs = [spec(v, "input") for v in model.graph.input if v.name not in initializers]
    return inputs, [spec(v, "output") for v in model.graph.output]


def _load_onnx(source: str | bytes, where: str) -> tuple[Any, list[IOSpec], list[IOSpec]]:
    import onnx

    try:
        model = onnx.load_from_string(source) if isinstance(source, bytes) else onnx.load(source)
    except Exception as exc:  # protobuf and IO errors alike
        raise EngineError(f"cannot read the ONNX model {where}: {exc}") from exc
    inputs, outputs = _onnx_specs(model)
    try:
        from onnx2torch import convert
    except ImportError as exc:
        raise EngineError("engine 'torch' runs ONNX files through onnx2torch: pip install onnx2torch") from exc
    try:
        module = convert(model)
    except Exception as exc:  # onnx2torch raises NotImplementedError, KeyError, ... for unsupported graphs
        raise EngineError(f"onnx2torch cannot convert {where}: {exc}") from exc
    folded, left = fold_constant_reshapes(module)
    log.debug("%s: %d constant Reshapes folded, %d dynamic ones left", where, folded, left)
    return module, inputs, outputs


def _exported_io(program: Any, where: str) -> tuple[list[IOSpec], list[IOSpec]]:
    """IOSpecs of an ExportedProgram from its placeholders' and outputs' example values (symbolic = dynamic)."""
    signature = program.graph_signature
    nodes = {n.name: n for n in program.graph.nodes}
    output_node = next(n for n in program.graph.nodes if n.op == "output")
    results = list(output_node.args[0])[-len(signature.user_outputs) :]

    def spec(node: Any, name: str, role: str) -> IOSpec:
        val = node.meta.get("val") if hasattr(node, "meta") else None
        if val is None or not hasattr(val, "shape"):
            raise EngineError(f"{where}: {role} {name!r} has no tensor metadata; declare the IO in a sidecar")
        dims = [d if isinstance(d, int) else None for d in val.shape]
        return spec_from_dims(name, _numpy_dtype(val.dtype, f"{role} {name!r}"), dims, role)

    inputs = [spec(nodes[name], name, "input") for name in signature.user_inputs]
    outputs = [spec(node, str(name), "output") for node, name in zip(results, signature.user_outputs, strict=True)]
    return inputs, outputs


def _exported_module(program: Any, device: Any) -> Any:
    try:
        from torch.export.passes import move_to_device_pass
    except ImportError:  # torch < 2.6: the unlifted module is moved with .to() later
        return program.module()
    return move_to_device_pass(program, device).module()


def _load_file(path: str, device: Any) -> tuple[Any, list[IOSpec], list[IOSpec]]:
    torch = _torch()
    meta = read_sidecar(path)
    where = f"sidecar of {path}"
    if meta is None and not path.endswith(_EXPORTED):
        raise EngineError(f"TorchScript {path} declares no IO: write {path}.json with 'inputs' and 'outputs'")
    inputs: list[IOSpec] = []
    outputs: list[IOSpec] = []
    try:
        if path.endswith(_EXPORTED):
            program = torch.export.load(path)
            if meta is None:
                inputs, outputs = _exported_io(program, path)
            module = _exported_module(program, device)
        else:
            module = torch.jit.load(path, map_location="cpu")
    except (RuntimeError, ValueError, OSError) as exc:
        raise EngineError(f"PyTorch cannot load {path}: {exc}") from exc
    if meta is not None:
        inputs = specs_from_json(meta.get("inputs"), "input", where)
        outputs = specs_from_json(meta.get("outputs"), "output", where)
    return module, inputs, outputs


def _as_list(result: Any, count: int, torch: Any) -> list[Any]:
    outs = [result] if isinstance(result, torch.Tensor) else list(result)
    if len(outs) != count:
        raise EngineError(f"the module returned {len(outs)} outputs, the model declares {count}")
    return outs


class TorchEngine:
    """A PyTorch module on CUDA device ``device``; a DeviceEngine (see base.py).

    TF32 is switched off process-wide: with it on, fp32 convolutions differ from ONNX Runtime by about 1e-3.
    ``fp16``: the module runs in half precision; inputs are cast on the device and outputs cast back to the
    declared dtypes, so clients send and receive the same dtypes either way.
    """

    def __init__(self, source: str | bytes, *, device: int, fp16: bool = False, cuda_graphs: bool = True) -> None:
        torch = _torch()
        if not torch.cuda.is_available() or device >= torch.cuda.device_count():
            raise EngineError(f"engine 'torch': PyTorch sees no CUDA device {device} (worker.devices)")
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        self.device = device
        self._dev = torch.device("cuda", device)
        if isinstance(source, bytes) or source.endswith(".onnx"):
            where = "<model bytes>" if isinstance(source, bytes) else source
            module, self.inputs, self.outputs = _load_onnx(source, where)
        elif source.endswith(_TORCHSCRIPT + _EXPORTED):
            module, self.inputs, self.outputs = _load_file(source, self._dev)
        else:
            raise EngineError(f"engine 'torch' loads .onnx, {'/'.join(_TORCHSCRIPT + _EXPORTED)} files, not {source}")
        try:
            module.eval()
        except NotImplementedError:  # an ExportedProgram's module refuses eval(); it runs as it was exported
            log.debug("%s: the module has no eval mode", source if isinstance(source, str) else "<model bytes>")
        for param in module.parameters():  # ScriptModules refuse requires_grad_(); their parameters do not
            param.requires_grad_(False)
        if fp16:
            module.half()
        self._module = module.to(self._dev)
        self.fp16 = fp16
        self.cuda_graphs = cuda_graphs
        half = torch.float16
        self._feed_dtypes = [
            half if fp16 and np.issubdtype(s.dtype, np.floating) else _torch_dtype(s.dtype) for s in self.inputs
        ]
        self._out_dtypes = [_torch_dtype(s.dtype) for s in self.outputs]
        self.graphs_failed: str | None = None  # why capture failed once; later contexts then skip it
        self._create_lock = threading.Lock()

    def call_module(self, inputs: list[Any], rows: int) -> list[Any]:
        """Run the module on the first ``rows`` rows of device tensors ``inputs``; the raw outputs (no sync)."""
        args = [t[:rows] if t.dtype == dt else t[:rows].to(dt) for t, dt in zip(inputs, self._feed_dtypes, strict=True)]
        return _as_list(self._module(*args), len(self.outputs), _torch())

    def run(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        """Host arrays in, host arrays out, on the current stream; synchronous (warm-up and tests)."""
        torch = _torch()
        with torch.inference_mode(), torch.cuda.device(self._dev):
            tensors = [torch.as_tensor(np.ascontiguousarray(feeds[s.name]), device=self._dev) for s in self.inputs]
            rows = int(tensors[0].shape[0]) if tensors else 0
            outs = self.call_module(tensors, rows)
            return [o.to(dt).cpu().numpy() for o, dt in zip(outs, self._out_dtypes, strict=True)]

    def create_context(self, index: int, stream: int, max_batch: int) -> TorchContext:
        """Stream slot ``index``'s buffers, warm allocator and graphs; contexts are made one at a time."""
        with self._create_lock:
            return TorchContext(self, index, stream, max_batch)

    def close(self) -> None:
        torch = _torch()
        del self._module
        torch.cuda.empty_cache()


class TorchContext:
    """One stream slot of a TorchEngine (a DeviceContext): fixed device buffers, graphs keyed by row count.

    The CUDA stream belongs to the caller, who keeps it alive longer than the context. ``enqueue`` of one
    context is not reentrant (one slot, one thread at a time); different contexts may enqueue concurrently.
    """

    def __init__(self, engine: TorchEngine, index: int, stream: int, max_batch: int) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        torch = _torch()
        self._torch = torch
        self._engine = engine
        self.index = index
        self.max_batch = max_batch
        self._stream = torch.cuda.ExternalStream(stream, device=engine._dev)
        with torch.cuda.stream(self._stream):
            self._inputs = [
                torch.zeros((max_batch, *s.item_shape), dtype=_torch_dtype(s.dtype), device=engine._dev)
                for s in engine.inputs
            ]
            self._outputs = [
                torch.zeros((max_batch, *s.item_shape), dtype=dt, device=engine._dev)
                for s, dt in zip(engine.outputs, engine._out_dtypes, strict=True)
            ]
        self.input_ptrs = [int(t.data_ptr()) for t in self._inputs]
        self.output_ptrs = [int(t.data_ptr()) for t in self._outputs]
        self._graphs: dict[int, Any] = {}
        self._warm_up()
        if engine.cuda_graphs and engine.graphs_failed is None:
            self._capture()
        self._stream.synchronize()

    @property
    def graph_sizes(self) -> list[int]:
        """The row counts that replay a CUDA graph (empty when running eagerly)."""
        return sorted(self._graphs)

    def _body(self, rows: int, check: bool = False) -> None:
        outs = self._engine.call_module(self._inputs, rows)
        for dst, src, spec in zip(self._outputs, outs, self._engine.outputs, strict=True):
            if check and tuple(src.shape) != (rows, *spec.item_shape):
                raise EngineError(
                    f"output {spec.name!r} came back {list(src.shape)} for {rows} rows, "
                    f"declared {[rows, *spec.item_shape]}"
                )
            dst[:rows].copy_(src)  # casts back to the declared dtype in fp16 mode

    def _warm_up(self) -> None:
        # every batch size once, on this stream: the caching allocator then holds what each size needs,
        # so the request path allocates nothing new, and cuDNN/cuBLAS state exists before any capture
        torch = self._torch
        with torch.inference_mode(), torch.cuda.stream(self._stream):
            for rows in range(1, self.max_batch + 1):
                self._body(rows, check=True)

    def _capture(self) -> None:
        torch = self._torch
        engine = self._engine
        pool = torch.cuda.graph_pool_handle()  # one pool per context: its graphs only ever run in turn
        graphs: dict[int, Any] = {}
        try:
            for rows in range(1, self.max_batch + 1):
                graph = torch.cuda.CUDAGraph()
                with (
                    torch.inference_mode(),
                    torch.cuda.graph(graph, pool=pool, stream=self._stream, capture_error_mode="thread_local"),
                ):
                    self._body(rows)
                graphs[rows] = graph
        except RuntimeError as exc:  # how torch reports a capture fault (a host sync, an uncapturable op)
            engine.graphs_failed = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            log.warning("cuda:%d: CUDA graph capture failed, running eagerly: %s", engine.device, engine.graphs_failed)
            torch.cuda.synchronize(engine._dev)
            self._warm_up()  # capture emptied the allocator's cache; refill it for the eager path
            return
        self._graphs = graphs

    def enqueue(self, rows: int) -> None:
        """Run rows [0, rows) of the input buffers into the output buffers, on this context's stream.

        Asynchronous: no host sync, and no device allocation beyond what warm-up left in the allocator.
        """
        if not 1 <= rows <= self.max_batch:
            raise ValueError(f"rows must be in [1, {self.max_batch}], got {rows}")
        torch = self._torch
        graph = self._graphs.get(rows)
        with torch.cuda.stream(self._stream):
            if graph is not None:
                graph.replay()
            else:
                with torch.inference_mode():
                    self._body(rows)

    def close(self) -> None:
        self._graphs.clear()
        self._inputs.clear()
        self._outputs.clear()
