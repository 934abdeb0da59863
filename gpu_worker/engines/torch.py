"""PyTorch on a GPU: an ONNX file through onnx2torch, a TorchScript file or an ExportedProgram, run on the
pipeline's own CUDA streams, in fp32 (TF32 off) or fp16, with one CUDA graph per batch size.

Sources: ``.onnx`` (or model bytes) via onnx2torch; ``.pt``/``.ts``/``.pth``/``.torchscript`` via
``torch.jit.load`` (IO declared in the sidecar ``<file>.json``, see ``engines/meta.py``); ``.pt2`` via
``torch.export.load`` (IO read from the program, or from a sidecar when present).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from shmbroker.gpu_worker.engines.base import EngineError, IOSpec, gpu_ordinal
from shmbroker.gpu_worker.engines.graphed import Body, GraphedContext, as_list, graph_ladder, torch_dtype, torch_module
from shmbroker.gpu_worker.engines.meta import onnx_specs, read_sidecar, spec_from_dims, specs_from_json

if TYPE_CHECKING:
    from shmbroker.broker.common.config import ModelSection

log = logging.getLogger(__name__)

_TORCHSCRIPT = (".pt", ".ts", ".pth", ".torchscript")
_EXPORTED = (".pt2",)


def _numpy_dtype(torch_dtype: Any, what: str) -> np.dtype[Any]:
    try:
        dtype: np.dtype[Any] = np.dtype(torch_module().empty(0, dtype=torch_dtype).numpy().dtype)
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

    torch = torch_module()
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


def load_onnx(source: str | bytes, where: str) -> tuple[Any, list[IOSpec], list[IOSpec]]:
    """An ONNX model as a PyTorch module (onnx2torch, constant Reshapes folded) with its IO; EngineError says
    what failed. ``where`` names the model in messages."""
    import onnx

    try:
        model = onnx.load_from_string(source) if isinstance(source, bytes) else onnx.load(source)
    except Exception as exc:  # protobuf and IO errors alike
        raise EngineError(f"cannot read the ONNX model {where}: {exc}") from exc
    inputs, outputs = onnx_specs(model)
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
    torch = torch_module()
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


class TorchEngine:
    """A PyTorch module on CUDA device ``device``; a DeviceEngine (see base.py).

    TF32 is switched off process-wide: with it on, fp32 convolutions differ from ONNX Runtime by about 1e-3.
    ``fp16``: the module runs in half precision; inputs are cast on the device and outputs cast back to the
    declared dtypes, so clients send and receive the same dtypes either way.
    """

    @classmethod
    def from_config(cls, source: str | bytes, *, device: int | None, model: ModelSection) -> TorchEngine:
        """The table's constructor: reads ``fp16`` and ``cuda_graphs``."""
        return cls(source, device=gpu_ordinal(device, "torch"), fp16=model.fp16, cuda_graphs=model.cuda_graphs)

    def __init__(self, source: str | bytes, *, device: int, fp16: bool = False, cuda_graphs: bool = True) -> None:
        torch = torch_module()
        if not torch.cuda.is_available() or device >= torch.cuda.device_count():
            raise EngineError(f"engine 'torch': PyTorch sees no CUDA device {device} (worker.devices)")
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        self.device = device
        self._dev = torch.device("cuda", device)
        if isinstance(source, bytes) or source.endswith(".onnx"):
            where = "<model bytes>" if isinstance(source, bytes) else source
            module, self.inputs, self.outputs = load_onnx(source, where)
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
            half if fp16 and np.issubdtype(s.dtype, np.floating) else torch_dtype(s.dtype) for s in self.inputs
        ]
        self._out_dtypes = [torch_dtype(s.dtype) for s in self.outputs]
        self.graphs_failed: str | None = None  # why capture failed once; later contexts then skip it
        self._create_lock = threading.Lock()

    def call_module(self, inputs: list[Any], rows: int) -> list[Any]:
        """Run the module on the first ``rows`` rows of device tensors ``inputs``; the raw outputs (no sync)."""
        args = [t[:rows] if t.dtype == dt else t[:rows].to(dt) for t, dt in zip(inputs, self._feed_dtypes, strict=True)]
        return as_list(self._module(*args), len(self.outputs))

    def run(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        """Host arrays in, host arrays out, on the current stream; synchronous (warm-up and tests)."""
        torch = torch_module()
        with torch.inference_mode(), torch.cuda.device(self._dev):
            tensors = [torch.as_tensor(np.ascontiguousarray(feeds[s.name]), device=self._dev) for s in self.inputs]
            rows = int(tensors[0].shape[0]) if tensors else 0
            outs = self.call_module(tensors, rows)
            return [o.to(dt).cpu().numpy() for o, dt in zip(outs, self._out_dtypes, strict=True)]

    def bind(self, index: int) -> Body:
        """Every stream slot runs the one module (a GraphedEngine)."""
        return self.call_module

    def prepared_sizes(self, max_batch: int, wanted: Sequence[int] | None) -> list[int]:
        """``graph_ladder(max_batch)``, or just ``wanted``: each size gets its own graph."""
        return sorted(set(wanted)) if wanted else graph_ladder(max_batch)

    def create_context(self, index: int, stream: int, max_batch: int,
                       sizes: Sequence[int] | None = None) -> GraphedContext:
        """Stream slot ``index``'s buffers, warm allocator and graphs (for ``sizes`` only, when given: the bench's
        sweep); contexts are made one at a time."""
        with self._create_lock:
            return GraphedContext(self, index, stream, max_batch, sizes)

    def close(self) -> None:
        torch = torch_module()
        del self._module
        torch.cuda.empty_cache()
