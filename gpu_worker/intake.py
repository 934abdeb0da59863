"""Checks every descriptor of a SUBMIT against the sender's own slot and the model, before anything is read.

The checks are written so that a C port needs no change: spans are tested as ``offset <= cap`` and
``size <= cap - offset``. A rejected request gets a Status and a message that names the field.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shmbroker.broker.common import protocol as P
from shmbroker.broker.common.protocol import SlotState
from shmbroker.broker.common.ring import RingError, check_span
from shmbroker.gpu_worker.engines.base import IOSpec
from shmbroker.gpu_worker.sessions import WorkerSession


class Rejected(Exception):
    """A request that fails a check; ``claimed`` says whether its slot was taken (and must be freed)."""

    def __init__(self, status: P.Status, message: str, claimed: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.claimed = claimed


@dataclass(frozen=True, slots=True)
class Photos:
    """A model whose clients send images or frames (``models.NAME.input``), its limits and their settings."""

    kind: str  # P.InputKind.IMAGE or FRAMES
    max_bytes: int
    max_pixels: int
    preset: str

    def setting(self, model: str, key: str) -> str:
        return f"models.{model}.{key}"


@dataclass(frozen=True, slots=True)
class ModelView:
    """What intake needs to know of a model served by this worker. ``inputs`` are what clients send: the
    engine's own, or for a model with ``photos`` the images or frames that its preset turns into them."""

    model_id: int
    name: str
    max_batch: int
    inputs: list[IOSpec]
    outputs: list[IOSpec]
    timeout_ms: int
    photos: Photos | None = None


def out_layout(outputs: list[IOSpec], rows: int) -> tuple[list[int], int]:
    """Offsets of a ``rows``-row request's outputs in its slot (packed as protocol.pack_offsets says), and the end."""
    return P.pack_offsets([rows * o.item_bytes for o in outputs])


def check_slot(session: WorkerSession, req: P.SubmitRequest) -> None:
    """The slot exists, is the sender's current generation, and has no request in flight; then claim it."""
    if req.slot >= session.layout.n_slots:
        raise Rejected(P.Status.BAD_SLOT, f"slot {req.slot} is out of range (the ring has {session.layout.n_slots})")
    state, generation, _rid, _status = session.segment.read_slot(req.slot)
    if state != SlotState.SUBMITTED or generation != req.generation:
        raise Rejected(
            P.Status.STALE_GENERATION,
            f"slot {req.slot}: generation {req.generation} is not the slot's submitted generation",
        )
    if not session.claim_slot(req.slot):
        raise Rejected(P.Status.BAD_SLOT, f"slot {req.slot} already has a request in flight")


def check_tensors(session: WorkerSession, req: P.SubmitRequest, model: ModelView) -> int:
    """Validate each input descriptor; return the request's row count."""
    if model.photos is not None and model.photos.kind == P.InputKind.IMAGE:
        return check_images(session, req, model, model.photos)
    if len(req.tensors) != len(model.inputs):
        raise Rejected(
            P.Status.BAD_INPUT, f"model {model.name!r} takes {len(model.inputs)} inputs, got {len(req.tensors)}", True
        )
    rows: int | None = None
    seen: set[int] = set()
    for t in req.tensors:
        if t.index >= len(model.inputs) or t.index in seen:
            raise Rejected(P.Status.BAD_INPUT, f"input index {t.index} is out of range or repeated", True)
        seen.add(t.index)
        spec = model.inputs[t.index]
        rows = _check_one(session, t, spec, model, rows)
    if rows is None:
        raise Rejected(P.Status.BAD_INPUT, "a request needs at least one input", True)
    if out_layout(model.outputs, rows)[1] > session.layout.out_capacity:
        raise Rejected(P.Status.BAD_SIZE, f"outputs of {rows} rows exceed the slot's output region", True)
    return rows


def _check_one(session: WorkerSession, t: P.TensorDesc, spec: IOSpec, model: ModelView, rows: int | None) -> int:
    field = f"inputs[{spec.name!r}]"
    code = P.dtype_from_int(t.dtype)
    if code is None or P.numpy_dtype(code) != spec.dtype:
        got = P.numpy_dtype(code).name if code is not None else f"code {t.dtype}"
        raise Rejected(P.Status.BAD_DTYPE, f"{field}.dtype: expected {spec.dtype.name}, got {got}", True)
    if len(t.shape) != len(spec.shape) or tuple(t.shape[1:]) != spec.item_shape:
        raise Rejected(
            P.Status.BAD_SHAPE, f"{field}.shape: expected [N, {', '.join(map(str, spec.item_shape))}], got "
            f"{list(t.shape)}", True,
        )
    n = t.shape[0]
    limit = min(model.max_batch, session.max_items)
    if not 1 <= n <= limit:
        raise Rejected(P.Status.BAD_SHAPE, f"{field}.shape[0]: expected 1..{limit} rows, got {n}", True)
    if rows is not None and n != rows:
        raise Rejected(P.Status.BAD_SHAPE, f"{field}.shape[0]: {n} rows, but another input has {rows}", True)
    expected = n * spec.item_bytes
    if t.nbytes != expected:
        raise Rejected(P.Status.BAD_SIZE, f"{field}.nbytes: shape {list(t.shape)} needs {expected}, got {t.nbytes}",
                       True)
    if t.offset % spec.dtype.itemsize:
        raise Rejected(P.Status.BAD_SIZE, f"{field}.offset {t.offset} is not a multiple of {spec.dtype.itemsize}",
                       True)
    try:
        check_span(f"{field}", t.offset, t.nbytes, session.layout.in_capacity)
    except RingError as exc:
        raise Rejected(P.Status.BAD_SIZE, str(exc), True) from None
    return n


def check_images(session: WorkerSession, req: P.SubmitRequest, model: ModelView, photos: Photos) -> int:
    """An image input (PROTOCOL 5.4): one UINT8 descriptor of [rows], its span in the slot, its row table's
    spans within it, and each row's length within ``max_image_bytes``; return the row count."""
    field = f"inputs[{model.inputs[0].name!r}]"
    if len(req.tensors) != 1 or req.tensors[0].index != 0:
        raise Rejected(P.Status.BAD_INPUT, f"model {model.name!r} takes one input of images, got "
                       f"{len(req.tensors)} descriptors", True)
    t = req.tensors[0]
    if t.dtype != P.DType.UINT8 or len(t.shape) != 1:
        raise Rejected(P.Status.BAD_DTYPE, f"{field}: an image input is dtype code {int(P.DType.UINT8)} (uint8) "
                       f"with shape [rows], got code {t.dtype} and shape {list(t.shape)}", True)
    # not the session's max_items: a slot holds as many images as their bytes fit its input region, and R8
    # below bounds their outputs (PROTOCOL 3.1)
    rows = t.shape[0]
    if not 1 <= rows <= model.max_batch:
        raise Rejected(P.Status.BAD_SHAPE, f"{field}.shape[0]: expected 1..{model.max_batch} rows, got {rows}", True)
    try:
        check_span(field, t.offset, t.nbytes, session.layout.in_capacity)
    except RingError as exc:
        raise Rejected(P.Status.BAD_SIZE, str(exc), True) from None
    spans = image_spans(session, req.slot, t)
    if isinstance(spans, str):
        raise Rejected(P.Status.BAD_SIZE, f"{field}: {spans}", True)
    for k, (_off, n) in enumerate(spans):
        if not 1 <= n <= photos.max_bytes:
            raise Rejected(P.Status.BAD_SIZE, f"{field} row {k}: {n} bytes; expected 1..{photos.max_bytes} "
                           f"({photos.setting(model.name, 'max_image_bytes')})", True)
    if out_layout(model.outputs, rows)[1] > session.layout.out_capacity:
        raise Rejected(P.Status.BAD_SIZE, f"outputs of {rows} rows exceed the slot's output region", True)
    return rows


def image_spans(session: WorkerSession, slot: int, t: P.TensorDesc) -> list[tuple[int, int]] | str:
    """The rows' (offset, length) within the image input ``t`` of a slot, read from its table and checked
    (``protocol.image_spans``); ``t``'s own span was checked against the slot."""
    base = session.layout.input_bases[slot] + t.offset
    n_table = t.shape[0] * P.IMAGE_ROW.size
    if n_table > t.nbytes:
        return f"the row table of {t.shape[0]} rows needs {n_table} bytes; the input has {t.nbytes}"
    return P.image_spans(session.segment.buf[base : base + n_table], t.shape[0], t.nbytes)


def image_rows(session: WorkerSession, req: P.SubmitRequest) -> list[memoryview] | str:
    """Each image row of a checked request (its first input) as a view of its slot, or why its row table is
    bad: read again where the rows are decoded, since the client may have written its slot since intake."""
    t = req.tensors[0]
    spans = image_spans(session, req.slot, t)
    if isinstance(spans, str):
        return spans
    buf = session.segment.buf
    base = session.layout.input_bases[req.slot] + t.offset
    return [buf[base + off : base + off + n] for off, n in spans]


def input_arrays(session: WorkerSession, req: P.SubmitRequest, model: ModelView) -> list[np.ndarray]:
    """Views of a checked request's inputs in its slot, in model input order."""
    views: list[np.ndarray] = [np.empty(0)] * len(model.inputs)
    for t in req.tensors:
        spec = model.inputs[t.index]
        views[t.index] = session.segment.input_view(req.slot, t.offset, spec.dtype, t.shape)
    return views
