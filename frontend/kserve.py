"""The KServe v2 / Triton HTTP inference protocol's bodies: parse an infer request, build its response.

Pure functions over bytes and numpy arrays, no I/O, so the front-ends stay thin adapters: the front-end
process (frontend/server.py, aiohttp) and the Ray Serve replica (shmbroker/ray/http.py, Starlette); an error's
HTTP status is ``status_of`` for both. Supported: JSON tensors (flat or nested ``data`` in row-major order)
and the binary tensor data extension: a JSON header of ``Inference-Header-Content-Length`` bytes, then each
binary input's bytes in input order, sized by its ``parameters.binary_data_size``. Outputs are binary when the
output asks ``parameters.binary_data``, else when the request asks ``parameters.binary_data_output``.
An input of encoded images (kind "image") is a ``BYTES`` tensor of shape [N] or [N, 1] in the binary data, each
element a 4-byte little-endian length then that many bytes (one image each); or, for one photo, the whole body
is the image (``parse_image_body``). No other input is ``BYTES``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from shmbroker.broker.common import protocol as P
from shmbroker.client.errors import BadInput, Overloaded, RequestTimeout, ShmBrokerError, UnknownModel, WorkerDied

# KServe v2 datatype <-> the broker's numpy dtype names (TensorSpec.dtype); the DType names already match
DATATYPE_OF: dict[str, str] = {np.dtype(P.numpy_dtype(d)).name: d.name for d in P.DType}
NUMPY_OF: dict[str, np.dtype[Any]] = {d.name: P.numpy_dtype(d) for d in P.DType}
MAX_TIMEOUT_US = 0xFFFF_FFFF  # the ring protocol's timeout_us is a u32
BYTES = "BYTES"  # the datatype of an image input: its elements are the images' bytes
ELEMENT_LENGTH = P.BYTES_ELEMENT_LENGTH  # the binary extension's BYTES element: a u32 length, then the bytes
JSON_TYPE = "application/json"
# The Content-Types of a body that is one image, for a model of images (no Inference-Header-Content-Length):
# the image's own, the generic binary one, and curl's default for --data-binary, so that a bare
# `curl --data-binary @photo.jpg URL` works too. Any other body is a KServe v2 request.
IMAGE_TYPES = ("image/jpeg", "image/png")
RAW_TYPES = (*IMAGE_TYPES, "application/octet-stream", "application/x-www-form-urlencoded")
HEADER_LENGTH = "Inference-Header-Content-Length"  # the binary extension's header: the JSON part's length


class HttpError(Exception):
    """A request the front-end answers with ``status`` and the protocol's error JSON ``{"error": message}``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def status_of(exc: ShmBrokerError) -> int:
    """The HTTP status of a ring client error: 400 bad input, 404 unknown model, 503 overloaded or worker died,
    504 timeout, 500 anything else."""
    if isinstance(exc, BadInput):
        return 400
    if isinstance(exc, UnknownModel):
        return 404
    if isinstance(exc, Overloaded | WorkerDied):
        return 503
    if isinstance(exc, RequestTimeout):
        return 504
    return 500


def bad(message: str) -> HttpError:
    return HttpError(400, message)


@dataclass
class InferRequest:
    """A decoded infer request: input arrays in the model's order (or, for a model of images, the images, views
    of the body), and which outputs to return how."""

    id: str | None
    inputs: dict[str, np.ndarray]
    outputs: list[tuple[str, bool]]  # (name, binary) in the order to return them
    timeout_s: float | None = None
    parameters: dict[str, Any] = field(default_factory=dict)
    images: list[memoryview] | None = None  # a model of images: one encoded image a row, in place of ``inputs``

    def payload(self) -> dict[str, np.ndarray] | list[memoryview]:
        """What the ring client takes: the images of a model of images, else the arrays by name."""
        return self.inputs if self.images is None else self.images


def model_metadata(info: P.ModelInfo, platform: str = "onnxruntime_onnx") -> dict[str, Any]:
    """``GET /v2/models/{name}``: name, versions, platform, and each tensor's name, datatype and shape."""

    def tensors(specs: list[P.TensorSpec]) -> list[dict[str, Any]]:
        return [{"name": s.name, "datatype": BYTES if s.kind == P.InputKind.IMAGE else DATATYPE_OF[s.dtype],
                 "shape": list(s.shape)} for s in specs]

    return {"name": info.name, "versions": ["1"], "platform": platform,
            "inputs": tensors(info.inputs), "outputs": tensors(info.outputs)}


def _object(value: object, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise bad(f"{where}: expected a JSON object, got {type(value).__name__}")
    return value


def _header(body: bytes, header_length: str | None) -> tuple[dict[str, Any], int]:
    """The JSON header and where the binary data starts."""
    if header_length is None:
        end = len(body)
    else:
        try:
            end = int(header_length)
        except ValueError:
            raise bad(f"Inference-Header-Content-Length: expected an integer, got {header_length!r}") from None
        if not 0 < end <= len(body):
            raise bad(f"Inference-Header-Content-Length: expected 1..{len(body)} (the body's length), got {end}")
    try:
        doc = msgspec.json.decode(body[:end])
    except msgspec.DecodeError as exc:
        raise bad(f"request body: expected a JSON object: {exc}") from None
    except RecursionError:
        # msgspec recurses once per nesting level and stops at the interpreter's recursion limit (about 1000
        # levels, fewer under aiohttp's call stack): the caller's JSON, not the server, is at fault
        raise bad("request body: the JSON nests arrays or objects too deeply to decode (an infer request "
                  "needs a few levels; send tensor data flat, in row-major order)") from None
    return _object(doc, "request body"), end


def _shape(entry: dict[str, Any], where: str, spec: P.TensorSpec) -> tuple[int, ...]:
    shape = entry.get("shape")
    if not isinstance(shape, list) or not all(type(d) is int for d in shape):
        raise bad(f"{where}.shape: expected a list of integers, got {shape!r}")
    want = spec.shape[1:]
    if len(shape) != len(spec.shape) or shape[1:] != want or shape[0] < 1:
        raise bad(f"{where}.shape: expected [N, {', '.join(map(str, want))}] with N >= 1, got {shape}")
    return tuple(shape)


def _tensor(entry: dict[str, Any], where: str, spec: P.TensorSpec, body: bytes, pos: int) -> tuple[np.ndarray, int]:
    """One input as an array (a view of ``body`` for binary data) and the binary position after it."""
    datatype = entry.get("datatype")
    want = DATATYPE_OF[spec.dtype]
    if datatype != want:
        raise bad(f"{where}.datatype: expected {want!r}, got {datatype!r}")
    shape = _shape(entry, where, spec)
    dt = NUMPY_OF[want]
    count = math.prod(shape)
    params = _object(entry.get("parameters", {}), f"{where}.parameters")
    size = params.get("binary_data_size")
    if size is not None:
        if "data" in entry:
            raise bad(f"{where}: has both data and parameters.binary_data_size; expected one of them")
        if type(size) is not int or size != count * dt.itemsize:
            raise bad(f"{where}.parameters.binary_data_size: expected {count * dt.itemsize} "
                      f"({count} x {want} for shape {list(shape)}), got {size!r}")
        if size > len(body) - pos:
            raise bad(f"{where}.parameters.binary_data_size: {size} bytes, but only {len(body) - pos} "
                      f"bytes of binary data are left in the body")
        return np.frombuffer(body, dt, count, pos).reshape(shape), pos + size
    if "data" not in entry:
        raise bad(f"{where}: expected data or parameters.binary_data_size")
    try:
        arr = np.asarray(entry["data"], dtype=dt)
    except (ValueError, TypeError, OverflowError) as exc:
        raise bad(f"{where}.data: expected numbers of datatype {want}: {exc}") from None
    if arr.size != count:
        raise bad(f"{where}.data: expected {count} elements for shape {list(shape)}, got {arr.size}")
    return arr.reshape(shape), pos


def image_size_error(n: int, info: P.ModelInfo, spec: P.TensorSpec, where: str, status: int = 400) -> HttpError:
    """An image of ``n`` bytes, 0 or over the model's ``max_image_bytes``: the error naming the setting."""
    return HttpError(status, f"{where}: an image of {n} bytes; model {info.name!r} takes 1..{spec.max_bytes} bytes "
                             f"an image (the broker's models.{info.name}.max_image_bytes)")


def _images(entry: dict[str, Any], where: str, spec: P.TensorSpec, info: P.ModelInfo, body: bytes,
            pos: int) -> tuple[list[memoryview], int]:
    """An image input's elements (views of ``body``, no copy) and the binary position after them: a BYTES tensor
    of shape [N] or [N, 1] in the binary data, each element a u32 little-endian length, then the image."""
    datatype = entry.get("datatype")
    if datatype != BYTES:
        raise bad(f"{where}.datatype: expected 'BYTES' (model {info.name!r} takes encoded images, one an element), "
                  f"got {datatype!r}")
    shape = entry.get("shape")
    if (not isinstance(shape, list) or not all(type(d) is int for d in shape) or len(shape) not in (1, 2)
            or shape[1:] not in ([], [1]) or shape[0] < 1):
        raise bad(f"{where}.shape: expected [N] or [N, 1] with N >= 1 (one image an element), got {shape!r}")
    rows = shape[0]
    if rows > info.max_batch:
        raise bad(f"{where}.shape[0]: expected 1..{info.max_batch} images (model {info.name!r} has max_batch "
                  f"{info.max_batch}), got {rows}")
    params = _object(entry.get("parameters", {}), f"{where}.parameters")
    size = params.get("binary_data_size")
    if "data" in entry or size is None:
        raise bad(f"{where}: images travel as binary data: give parameters.binary_data_size and the header "
                  f"Inference-Header-Content-Length, each element a 4-byte little-endian length then the image's "
                  f"bytes (or POST one image alone as the body, Content-Type image/jpeg or image/png)")
    if type(size) is not int or not 0 < size <= len(body) - pos:
        raise bad(f"{where}.parameters.binary_data_size: expected 1..{len(body) - pos} (the binary data left in "
                  f"the body), got {size!r}")
    end = pos + size
    view = memoryview(body)
    images: list[memoryview] = []
    for k in range(rows):
        if end - pos < ELEMENT_LENGTH.size:
            raise bad(f"{where}: binary_data_size {size} ends inside element {k}'s length; expected {rows} "
                      f"elements, each a 4-byte little-endian length then the image")
        (n,) = ELEMENT_LENGTH.unpack_from(body, pos)
        pos += ELEMENT_LENGTH.size
        if not 1 <= n <= spec.max_bytes:
            raise image_size_error(n, info, spec, f"{where} element {k}")
        if n > end - pos:
            raise bad(f"{where} element {k}: a length of {n} bytes, but only {end - pos} bytes of its "
                      f"binary_data_size are left")
        images.append(view[pos : pos + n])
        pos += n
    if pos != end:
        raise bad(f"{where}.parameters.binary_data_size: {size} bytes, but its {rows} elements take "
                  f"{size - (end - pos)}")
    return images, pos


def _inputs(doc: dict[str, Any], info: P.ModelInfo, body: bytes,
            pos: int) -> tuple[dict[str, np.ndarray], list[memoryview] | None]:
    """The arrays by name in model order, and a model of images' images (None for other models)."""
    entries = doc.get("inputs")
    if not isinstance(entries, list) or not entries:
        raise bad("inputs: expected a non-empty list of input tensors")
    specs = {s.name: s for s in info.inputs}
    arrays: dict[str, np.ndarray] = {}
    images: list[memoryview] | None = None
    seen: set[str] = set()
    for i, raw in enumerate(entries):
        where = f"inputs[{i}]"
        entry = _object(raw, where)
        name = entry.get("name")
        spec = specs.get(name) if isinstance(name, str) else None
        if spec is None:
            raise bad(f"{where}.name: expected one of {sorted(specs)} (model {info.name!r}), got {name!r}")
        if name in seen:
            raise bad(f"{where}.name: input {name!r} given twice")
        seen.add(spec.name)
        if spec.kind == P.InputKind.IMAGE:
            images, pos = _images(entry, where, spec, info, body, pos)
        else:
            arrays[spec.name], pos = _tensor(entry, where, spec, body, pos)
    missing = [s.name for s in info.inputs if s.name not in seen]
    if missing:
        raise bad(f"inputs: model {info.name!r} also needs {missing}")
    if pos != len(body):
        raise bad(f"binary data: {len(body) - pos} bytes after the last input's binary_data_size")
    return {s.name: arrays[s.name] for s in info.inputs if s.name in arrays}, images


def _outputs(doc: dict[str, Any], info: P.ModelInfo, binary_default: bool) -> list[tuple[str, bool]]:
    entries = doc.get("outputs")
    if entries is None:
        return [(s.name, binary_default) for s in info.outputs]
    if not isinstance(entries, list):
        raise bad("outputs: expected a list of requested outputs")
    names = [s.name for s in info.outputs]
    chosen: list[tuple[str, bool]] = []
    for i, raw in enumerate(entries):
        entry = _object(raw, f"outputs[{i}]")
        name = entry.get("name")
        if name not in names:
            raise bad(f"outputs[{i}].name: expected one of {names} (model {info.name!r}), got {name!r}")
        params = _object(entry.get("parameters", {}), f"outputs[{i}].parameters")
        binary = params.get("binary_data", binary_default)
        if type(binary) is not bool:
            raise bad(f"outputs[{i}].parameters.binary_data: expected true or false, got {binary!r}")
        chosen.append((str(name), binary))
    return chosen


def parse_infer(body: bytes, header_length: str | None, info: P.ModelInfo) -> InferRequest:
    """Decode ``POST /v2/models/{name}/infer``; raises HttpError(400) naming the field that is wrong.

    Binary inputs are views of ``body`` (no copy); the ring client copies them into its slot once.
    """
    doc, pos = _header(body, header_length)
    params = _object(doc.get("parameters", {}), "parameters")
    binary_default = params.get("binary_data_output", False)
    if type(binary_default) is not bool:
        raise bad(f"parameters.binary_data_output: expected true or false, got {binary_default!r}")
    timeout_s = None
    timeout = params.get("timeout")
    if timeout is not None:
        if type(timeout) is not int or not 0 < timeout <= MAX_TIMEOUT_US:
            raise bad(f"parameters.timeout: expected microseconds, 1..{MAX_TIMEOUT_US}, got {timeout!r}")
        timeout_s = timeout / 1e6
    rid = doc.get("id")
    if rid is not None and not isinstance(rid, str):
        raise bad(f"id: expected a string, got {rid!r}")
    arrays, images = _inputs(doc, info, body, pos)
    return InferRequest(rid, arrays, _outputs(doc, info, binary_default), timeout_s, params, images)


def takes_images(info: P.ModelInfo) -> bool:
    """Whether the model's input is encoded images (kind "image")."""
    return any(s.kind == P.InputKind.IMAGE for s in info.inputs)


def is_image_body(content_type: str, header_length: str | None, info: P.ModelInfo) -> bool:
    """Whether ``POST .../infer`` carries one image as its whole body rather than a KServe v2 request: a model of
    images, no Inference-Header-Content-Length, and a Content-Type of RAW_TYPES. HttpError 415 for an image's
    Content-Type sent to a model of tensors."""
    if not takes_images(info):
        if content_type in IMAGE_TYPES:
            raise HttpError(415, f"Content-Type {content_type}: model {info.name!r} takes tensors, not images; send "
                                 f"a KServe v2 request (application/json, or with the binary data extension)")
        return False
    return header_length is None and content_type in RAW_TYPES


def parse_image_body(body: bytes, info: P.ModelInfo) -> InferRequest:
    """The request of one image POSTed as the whole body: its one row, every output as JSON. 413 for an image
    over the model's ``max_image_bytes``, 400 for an empty body."""
    spec = next(s for s in info.inputs if s.kind == P.InputKind.IMAGE)
    if not 1 <= len(body) <= spec.max_bytes:
        raise image_size_error(len(body), info, spec, "request body", 413 if body else 400)
    return InferRequest(None, {}, [(s.name, False) for s in info.outputs], images=[memoryview(body)])


def encode_response(info: P.ModelInfo, req: InferRequest, outputs: dict[str, np.ndarray]) -> tuple[bytes, int | None]:
    """The response body and, when any output is binary, its JSON header's length (for the
    ``Inference-Header-Content-Length`` header); None means the body is all JSON."""
    dtypes = {s.name: s.dtype for s in info.outputs}
    entries: list[dict[str, Any]] = []
    chunks: list[memoryview] = []
    for name, binary in req.outputs:
        arr = np.ascontiguousarray(outputs[name])
        entry: dict[str, Any] = {"name": name, "datatype": DATATYPE_OF[dtypes[name]], "shape": list(arr.shape)}
        if binary:
            entry["parameters"] = {"binary_data_size": arr.nbytes}
            chunks.append(arr.data.cast("B"))
        else:
            entry["data"] = arr.ravel().tolist()
        entries.append(entry)
    doc: dict[str, Any] = {"model_name": info.name, "model_version": "1", "outputs": entries}
    if req.id is not None:
        doc["id"] = req.id
    header = msgspec.json.encode(doc)
    if not chunks:
        return header, None
    return b"".join([header, *chunks]), len(header)
