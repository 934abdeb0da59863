"""The client side of the handshake (HELLO -> SETUP -> ATTACHED -> READY) and the per-worker links."""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from shmbroker.broker.common import liveness, runtime
from shmbroker.broker.common import protocol as P
from shmbroker.broker.common.handout import HandoutError, fetch_ring
from shmbroker.broker.common.ring import RingLayout, Segment, check_span
from shmbroker.client.errors import HandshakeError, NoBroker

ImageRow = bytes | bytearray | memoryview
# one input's rows as a request carries them: a tensor input's array, or an image input's encoded rows
Column = np.ndarray | list[ImageRow]

GRACE_S = 2.0  # how long past its deadline a request may stay unanswered before the client gives up


@dataclass(frozen=True, slots=True)
class SlotViews:
    """One slot's tensors for one model and row count, as NumPy views into the ring at the canonical
    offsets: the client copies inputs in and outputs out through these (no view is built per request)."""

    rows: int
    layout: P.CanonicalRows
    ins: tuple[np.ndarray, ...]
    outs: tuple[np.ndarray, ...]
    segment: Segment  # the ring they view: a request written into a ring the client has left is not sent


@dataclass(frozen=True)
class ModelPlan:
    """A model as the client sees it, with the packing of its tensors precomputed per row count."""

    info: P.ModelInfo
    in_dtypes: list[np.dtype[Any]]
    in_item_shapes: list[tuple[int, ...]]
    out_dtypes: list[np.dtype[Any]]
    out_item_shapes: list[tuple[int, ...]]
    _layouts: dict[int, P.CanonicalRows]
    image_max_bytes: int = 0  # a model of encoded images (one input of kind IMAGE): a row's most bytes; else 0
    _slot_rows: dict[int, int] = field(default_factory=dict)  # image rows a slot's outputs hold, by out_capacity

    @classmethod
    def of(cls, info: P.ModelInfo) -> ModelPlan:
        images = [s.max_bytes for s in info.inputs if s.kind == P.InputKind.IMAGE]
        # an image input's item shape (-1,) matches no array's: arrays take the checks, which take its bytes
        return cls(
            info, [np.dtype(s.dtype) for s in info.inputs],
            [(-1,) if s.kind == P.InputKind.IMAGE else tuple(s.shape[1:]) for s in info.inputs],
            [np.dtype(s.dtype) for s in info.outputs], [tuple(s.shape[1:]) for s in info.outputs], {},
            images[0] if len(info.inputs) == 1 and images else 0,
        )

    def layout(self, rows: int) -> P.CanonicalRows:
        """The canonical layout of a request of ``rows`` rows, built at its first use."""
        lay = self._layouts.get(rows)
        if lay is None:
            ins = [(np.dtype(np.uint8), ())] if self.image_max_bytes else list(zip(self.in_dtypes,
                                                                                   self.in_item_shapes, strict=True))
            lay = self._layouts[rows] = P.CanonicalRows.of(
                ins,
                list(zip(self.out_dtypes, self.out_item_shapes, strict=True)), rows)
        return lay

    def image_views(self, segment: Segment, slot: int, images: Column, outs: tuple[np.ndarray, ...]) -> SlotViews:
        """Write ``images`` (encoded, one a row) into the slot's input region as PROTOCOL 5.4 lays them out: the
        row table, then the images in order; the views of this one request, its descriptor its own. RingError
        if they overflow the region. Each piece goes in with one memoryview copy and the layout is built field
        by field, not through NumPy views and ``dataclasses.replace``: this runs for every photo sent."""
        rows = len(images)
        table, offsets = P.pack_image_table([len(b) for b in images])
        total = offsets[-1] + len(images[-1])
        check_span("images", 0, total, segment.layout.in_capacity)
        buf, base = segment.buf, segment.layout.input_bases[slot]
        buf[base : base + len(table)] = table
        for off, data in zip(offsets, images, strict=True):
            buf[base + off : base + off + len(data)] = data
        desc = P.TensorDesc(0, int(P.DType.UINT8), 0, total, (rows,))
        canon = self.layout(rows)
        lay = P.CanonicalRows(rows=rows, in_descs=[desc], in_desc_bytes=P.pack_tensor(desc),
                              in_offsets=canon.in_offsets, in_nbytes=[total], out_descs=canon.out_descs,
                              out_desc_bytes=canon.out_desc_bytes, out_offsets=canon.out_offsets, ok=canon.ok)
        return SlotViews(rows, lay, (), outs, segment)

    def image_parts(self, images: list[ImageRow], layout: RingLayout) -> list[tuple[int, int]] | None:
        """None when ``images`` fit one slot of ``layout``, else the (first, end) rows of consecutive parts that
        each do: their row table and images within the input region, their outputs within the output region
        (PROTOCOL 3.1: a slot holds as many images as their bytes allow, not ``max_items``)."""
        most = self._slot_rows.get(layout.out_capacity)
        if most is None:
            sizes = [math.prod(shape) * dt.itemsize for dt, shape in zip(self.out_dtypes, self.out_item_shapes,
                                                                         strict=True)]
            most = self._slot_rows[layout.out_capacity] = max(1, P.rows_within(sizes, layout.out_capacity,
                                                                               self.info.max_batch))
        if len(images) <= most and P.IMAGE_ROW.size * len(images) + sum(map(len, images)) <= layout.in_capacity:
            return None
        spans, first, used = [], 0, 0
        for k, row in enumerate(images):
            need = P.IMAGE_ROW.size + len(row)
            if k > first and (k - first == most or used + need > layout.in_capacity):
                spans.append((first, k))
                first, used = k, 0
            used += need
        return [*spans, (first, len(images))]

    def input_offsets(self, rows: int) -> list[int]:
        return self.layout(rows).in_offsets

    def slot_views(self, segment: Segment, slot: int, rows: int) -> SlotViews:
        lay = self.layout(rows)
        ins = () if self.image_max_bytes else tuple(  # images: image_views writes each request's own layout
            segment.input_view(slot, off, dt, (rows, *shape))
            for off, dt, shape in zip(lay.in_offsets, self.in_dtypes, self.in_item_shapes, strict=True))
        outs = tuple(segment.output_view(slot, d.offset, self.out_dtypes[d.index], d.shape) for d in lay.out_descs)
        return SlotViews(rows, lay, ins, outs, segment)


@dataclass
class Handshake:
    setup: P.Setup
    ready: P.Ready
    segment: Segment


def _recv(sock: zmq.Socket[bytes], until: float, step: str) -> list[bytes]:
    remaining = until - time.monotonic()
    if remaining <= 0 or not sock.poll(int(remaining * 1000)):
        raise HandshakeError(
            f"no {step} from the broker in time; is `shmbroker serve` running on this runtime dir? "
            "(raise Client(connect_timeout=...) for a slow start)", "HANDSHAKE_TIMEOUT")
    return sock.recv_multipart()


def _expect(frames: list[bytes], kind: type[P.T]) -> P.T:
    msg = P.decode(frames)
    if isinstance(msg, P.ErrorReply):
        raise HandshakeError(msg.message, msg.code)
    if not isinstance(msg, kind):
        raise HandshakeError(f"expected {kind.__name__}, got {type(msg).__name__}", "BAD_MESSAGE")
    return msg


def handshake(ctl: zmq.Socket[bytes], runtime_dir: Path, slots: int, max_items: int, name: str,
              timeout: float) -> Handshake:
    """Run the session handshake on a connected control socket, taking the ring from the broker's handout in
    ``runtime_dir``; HandshakeError names the step that failed."""
    until = time.monotonic() + timeout
    ctl.send_multipart(P.encode(P.Hello(P.PROTOCOL_VERSION, os.getpid(), slots, max_items, name)))
    setup = _expect(_recv(ctl, until, "SETUP"), P.Setup)
    layout = RingLayout.of(setup)
    if layout.slot_stride != setup.slot_stride or layout.total_bytes != setup.segment_bytes:
        ctl.send_multipart(P.encode(P.Bye(setup.session_id)))
        raise HandshakeError("SETUP describes a ring layout this client does not derive", "BAD_LAYOUT")
    try:
        fd = fetch_ring(runtime_dir, setup.session_id, setup.token, max(until - time.monotonic(), 0.1))
        segment = Segment.from_fd(fd, layout)
    except HandoutError as exc:
        ctl.send_multipart(P.encode(P.Bye(setup.session_id)))
        raise HandshakeError(str(exc), "NO_RING") from None
    except BaseException:
        ctl.send_multipart(P.encode(P.Bye(setup.session_id)))  # the broker may release the ring at once
        raise
    try:
        liveness.hold(segment)  # before ATTACHED: from then on the broker knows this session lives by the lock
        ctl.send_multipart(P.encode(P.Attached(setup.session_id)))
        ready = _expect(_recv(ctl, until, "READY"), P.Ready)
    except BaseException:
        segment.close()
        raise
    return Handshake(setup, ready, segment)


def find_broker(runtime_dir: str | os.PathLike[str] | None, given_as: str) -> Path:
    """The runtime directory to use (``runtime_dir``, else ``runtime.resolve()``); NoBroker at once when no
    broker listens there, naming the directory and how it was chosen (``given_as`` when it was given);
    HandshakeError (UNSAFE_RUNTIME_DIR) for a per-user fallback directory that another user owns or may write."""
    rd, how = (Path(runtime_dir), f"given as {given_as}") if runtime_dir is not None else runtime.resolve_why()
    squat = runtime.squatted(rd)
    if squat:
        raise HandshakeError(squat, "UNSAFE_RUNTIME_DIR")
    if runtime.broker_absent(rd):
        raise NoBroker(f"no broker serves the runtime directory {rd} ({how}): start `shmbroker serve`, or name "
                       f"the broker's directory with ${runtime.ENV_VAR} or {given_as}")
    return rd


def rejoin_mismatch(setup: P.Setup, n_slots: int, max_items: int, models: list[P.ModelInfo]) -> str:
    """Why a new session cannot take the place of the old one after a broker restart ("" when it can): the
    client keeps its slots, rows and model plans, so the broker must grant the same."""
    if setup.n_slots != n_slots or setup.max_items != max_items:
        return (f"the broker granted {setup.n_slots} slots of {setup.max_items} rows, not {n_slots} of {max_items} "
                "as before")
    if sorted(setup.models, key=lambda m: m.model_id) != sorted(models, key=lambda m: m.model_id):
        return "the broker serves other models, or the same with other shapes"
    return ""


def control_socket(ctx: zmq.Context[zmq.Socket[bytes]], runtime_dir: Path) -> zmq.Socket[bytes]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 500)  # so a BYE still leaves when the client closes
    sock.connect(runtime.endpoint(runtime_dir, runtime.CONTROL_SOCKET))
    return sock
