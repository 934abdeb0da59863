"""``shmbroker inline``: the inline gateway, for callers that cannot map shared memory. Tensor bytes travel in frames.

A caller's DEALER sends ``[envelope(INLINE_REQUEST), JSON header, one frame per input]`` to this process's
ROUTER; the gateway, a ring client of the broker like the HTTP front-end (one ``AsyncClient`` session),
copies the frames into a ring slot, and answers ``[envelope(INLINE_REPLY), JSON header, one frame per
output]``. The shared-memory fast path is untouched: workers and the broker see an ordinary session.
Endpoints: ``ipc://<runtime_dir>/inline.sock`` always; ``tcp://...`` only with ``--tcp`` and then only
with CURVE (``--curve-secret-file``) and either ``--curve-clients DIR``, which limits callers to the public keys in
DIR, or ``--curve-any-client``, which serves any key pair.
Every message gets exactly one reply, with its request's id whenever the header has one; the gateway holds at
most ``--max-pending`` requests and ``--max-pending-mib`` of their bytes, and answers one more OVERLOADED at once.
One gateway per runtime directory: it holds an flock on ``inline.lock`` beside its socket for its whole life,
so a second one refuses to start, and on exit it removes its socket file if that is still the one it bound.
docs/PROTOCOL.md section 10 has the bytes.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import signal
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import zmq
import zmq.asyncio

from shmbroker.broker.common import protocol as P
from shmbroker.broker.common import runtime
from shmbroker.broker.common.protocol import (
    InlineModelsReply,
    InlineReply,
    InlineRequest,
    InlineRequestId,
    InlineTensor,
)
from shmbroker.broker.common.ratelog import RateLimitedLog
from shmbroker.client import AsyncClient, BadInput, RequestTimeout, ShmBrokerError
from shmbroker.client.checks import check_rows
from shmbroker.client.session import GRACE_S, ModelPlan
from shmbroker.frontend.unixclaim import UnixClaim

log = logging.getLogger(__name__)
SOCKET_NAME = "inline.sock"
LOCK_NAME = "inline.lock"  # not *.sock: the broker's stale-socket cleanup leaves it alone, and it is never unlinked
MAX_ITEMS_SETTING = "shmbroker inline --max-items"  # what a BAD_SHAPE answer over the session's rows names
SLOTS_SETTING = "shmbroker inline --slots"  # what a wait for a slot that timed out names
MAX_PENDING_SETTING = "shmbroker inline --max-pending"  # what an OVERLOADED answer of the gateway's names
MAX_PENDING_MIB_SETTING = "shmbroker inline --max-pending-mib"
MIB = 1 << 20
DRAIN_S = 10.0  # at a stop, how long the replies of accepted requests may take once the session is closed
SHUTDOWN_LINGER_MS = 500  # ... and how long ZeroMQ may take to deliver them when the sockets close


_DECODE = msgspec.json.Decoder(InlineRequest)
_DECODE_ID = msgspec.json.Decoder(InlineRequestId)
_ENCODE = msgspec.json.Encoder()
# The names of section 5.3, and only they: np.dtype() would also take '>f4' (big-endian), '(2,)f4' (a
# sub-array) or 'float128', none of which the frames can carry.
_DTYPES: dict[str, np.dtype[Any]] = {P.numpy_dtype(code).name: P.numpy_dtype(code) for code in P.DType}
_ID_RANGE = range(-(2**63), 2**64)  # ids of 64 bits, signed or unsigned: what a C caller can send and read back
_MAX_DIM = 2**63 - 1  # a dimension past int64 fits no array and no tensor descriptor
MAX_TIMEOUT_US = 0xFFFF_FFFF  # timeout_us is a u32 in the SUBMIT it becomes
MAX_HEADER_BYTES = 65536  # a header of a model with hundreds of inputs fits; one of millions would cost memory
# Section 10's header nests 4 deep (the object, inputs, an input, its shape); deeper is refused before the decoder
# sees it, as msgspec recurses once a level and a few hundred levels reach Python's recursion limit.
MAX_HEADER_DEPTH = 32
MAX_ID_READ_BYTES = 1 << 20  # a header frame larger than this is not read even for its id: it costs the loop time
_OPEN_LIST, _CLOSE_LIST, _OPEN_OBJECT, _CLOSE_OBJECT = b"[]{}"
_QUOTE, _BACKSLASH, _ZERO = b'"\\0'


def _clip(text: str, limit: int = 64) -> str:
    """``repr(text)``, cut to ``limit`` characters: a caller's string echoed in an error stays small."""
    r = repr(text)
    return r if len(r) <= limit else f"{r[:limit]}...' ({len(text)} characters)"


class Refused(ValueError):
    """An inline request answered with an error before it reaches the session: ``code`` (BAD_MESSAGE, or the
    protocol's code for a request that does not fit its model), the text naming the field, and ``rid``, the
    request's id (0 when none could be read)."""

    def __init__(self, message: str, rid: int = 0, code: str = "BAD_MESSAGE") -> None:
        super().__init__(message)
        self.rid = rid
        self.code = code


class BadMessage(Refused):
    """A Refused whose code is BAD_MESSAGE: the request does not follow section 10."""


def _depths(header: bytes) -> np.ndarray | None:
    """The nesting depth after each byte of ``header``, counting the brackets outside JSON strings; None when it
    has too few brackets to pass MAX_HEADER_DEPTH, which is every ordinary header."""
    if header.count(b"[") + header.count(b"{") <= MAX_HEADER_DEPTH:
        return None
    b = np.frombuffer(header, np.uint8)
    quotes = b == _QUOTE
    if b"\\" in header:
        # A quote is escaped when an odd run of backslashes precedes it. Outside strings a backslash is no JSON,
        # and the decoder stops there, before any depth this scan could miss.
        n = np.arange(b.size, dtype=np.int32)
        last_other = np.maximum.accumulate(np.where(b == _BACKSLASH, np.int32(-1), n))  # at or before i
        run_before = np.zeros_like(n)  # backslashes just before byte i
        run_before[1:] = n[:-1] - last_other[:-1]
        quotes &= run_before % 2 == 0
    # inside a string: after an opening quote, up to its closing one
    in_string = (np.bitwise_xor.accumulate(quotes.view(np.uint8)) ^ quotes).view(bool)
    step = ((b == _OPEN_LIST) | (b == _OPEN_OBJECT)).astype(np.int32) - ((b == _CLOSE_LIST) | (b == _CLOSE_OBJECT))
    step[in_string] = 0
    return np.cumsum(step, dtype=np.int32)


def _top_level(header: bytes, depths: np.ndarray) -> bytes:
    """``header`` with each value nested in a member of its top level replaced by ``0``: its top-level fields
    (the id among them) read as before, and it nests at most 1 deep."""
    step = np.diff(depths, prepend=0)
    nested = np.maximum(depths, depths - step) >= 2  # a byte of a container inside the top-level one
    first = nested & ~np.concatenate(([False], nested[:-1]))
    b = np.frombuffer(header, np.uint8)
    kept: np.ndarray = np.where(first, _ZERO, b)[~nested | first]
    return kept.tobytes()


def _header_id(header: bytes) -> int:
    """The header's integer ``id`` when it has one of 64 bits, even if the rest of it is wrong (nested past
    MAX_HEADER_DEPTH included); else 0. Never raises: every reply of a refusal calls it."""
    if len(header) > MAX_ID_READ_BYTES:
        return 0
    try:
        depths = _depths(header)
        if depths is not None and depths.max() > MAX_HEADER_DEPTH:
            header = _top_level(header, depths)
        rid = _DECODE_ID.decode(header).id
    except msgspec.DecodeError:
        return 0
    except Exception:  # a fault of this reader's must not cost the reply it is for
        log.exception("reading the id of a header of %d bytes failed", len(header))
        return 0
    return rid if rid in _ID_RANGE else 0


def rows_limit(models: Mapping[str, ModelPlan]) -> int:
    """The most rows a request may have: the largest ``max_batch`` (each model's own binds too)."""
    return max(p.info.max_batch for p in models.values())


def request_id(frames: list[bytes]) -> int:
    """The id of a message's header frame when it has a readable one, whatever else is wrong with it; else 0.
    Never raises."""
    return _header_id(frames[1]) if len(frames) >= 2 else 0  # envelope, header


def decode_request(frames: list[bytes], models: Mapping[str, ModelPlan],
                   max_items: int) -> tuple[InlineRequest, dict[str, np.ndarray] | list[bytes]]:
    """The header and the input arrays by name (views of the frames, no copy), or a model of images' images (its
    frames, one image each), checked against the frames and against ``models`` before any array is made; Refused
    names the field and carries the id once it could be read."""
    if len(frames) < 2:  # envelope, header
        raise BadMessage(f"frames: expected [envelope (4 bytes), JSON header, one frame per input], got "
                         f"{len(frames)} frames")
    if len(frames[0]) != P.ENVELOPE.size:
        raise BadMessage(f"envelope: expected 4 bytes <u16 version, u16 kind>, got {len(frames[0])} bytes",
                         _header_id(frames[1]))
    version, kind = P.ENVELOPE.unpack(frames[0])
    if version != P.PROTOCOL_VERSION or kind != P.MsgKind.INLINE_REQUEST:
        raise BadMessage(f"envelope: expected version {P.PROTOCOL_VERSION} kind {int(P.MsgKind.INLINE_REQUEST)}, "
                         f"got {version} {kind}", _header_id(frames[1]))
    if len(frames[1]) > MAX_HEADER_BYTES:  # decoded, a header takes a few times its size: bound it first
        raise BadMessage(f"header: {len(frames[1])} bytes, expected at most {MAX_HEADER_BYTES}",
                         _header_id(frames[1]))
    depths = _depths(frames[1])
    if depths is not None and (deepest := int(depths.max())) > MAX_HEADER_DEPTH:
        raise BadMessage(f"header: nested {deepest} deep, expected at most {MAX_HEADER_DEPTH} (a request's "
                         f"header nests 4 deep)", _header_id(frames[1]))
    try:
        req = _DECODE.decode(frames[1])
    except msgspec.DecodeError as exc:
        raise BadMessage(f"header: {exc}", _header_id(frames[1])) from None
    if req.id not in _ID_RANGE:
        raise BadMessage(f"id: expected an integer of 64 bits, got one of {req.id.bit_length()} bits")
    rid = req.id
    if not 0 <= req.timeout_us <= MAX_TIMEOUT_US:
        raise BadMessage(f"timeout_us: expected 0 (the model's timeout_ms) to {MAX_TIMEOUT_US}, got "
                         f"{req.timeout_us}", rid)
    data = frames[2:]
    images = _image_inputs(req, models)
    # a negative count (refused below, as every negative dimension is) must not let the groups slip
    counts = [max(t.shape[0], 0) if t.name in images and len(t.shape) == 1 else 1 for t in req.inputs]
    if len(data) != sum(counts):
        raise BadMessage(f"frames: the header names {len(req.inputs)} inputs, {len(data)} data frames follow "
                         f"(one per input, in the header's order, and one per image for an input of images of "
                         f"shape [N]: {sum(counts)} here)", rid)
    ends = np.cumsum(counts).tolist()
    groups = [data[end - n : end] for n, end in zip(counts, ends, strict=True)]
    dtypes = _checked_frames(req, groups, images)
    _check_model(req, models, max_items, groups)
    # Only now: the frames hold exactly product(shape) items, and the shapes are the model's, so reshape
    # neither allocates nor meets a dimension numpy refuses.
    if images:  # a model of images has that one input (ModelPlan.image_max_bytes)
        return req, groups[0]
    return req, {t.name: np.frombuffer(group[0], dt).reshape(t.shape)
                 for t, group, dt in zip(req.inputs, groups, dtypes, strict=True)}


def _image_inputs(req: InlineRequest, models: Mapping[str, ModelPlan]) -> set[str]:
    """The names of the request's inputs that its model takes as encoded images: one of shape [N] comes as N
    frames, one image each; another shape counts one frame, and the model's check refuses it."""
    plan = models.get(req.model)
    if plan is None:
        return set()
    return {s.name for s in plan.info.inputs if s.kind == P.InputKind.IMAGE}


def _checked_frames(req: InlineRequest, groups: list[list[bytes]], images: set[str]) -> list[np.dtype[Any]]:
    """Each input's dtype; BadMessage unless its name is new, its dtype one of 5.3's, and its frame holds exactly
    product(shape) * itemsize bytes (an input of images: its frames are checked against the model). At most
    MAX_DIMS dimensions, each below 2**63, are multiplied, so the product costs nothing whatever the caller sent,
    and it is compared with the frame before anything is made."""
    rid = req.id
    seen: dict[str, int] = {}
    dtypes: list[np.dtype[Any]] = []
    for i, (t, group) in enumerate(zip(req.inputs, groups, strict=True)):
        if t.name in seen:
            raise BadMessage(f"inputs[{i}].name: input {_clip(t.name)} is given twice (inputs[{seen[t.name]}] "
                             f"too); give each input once", rid)
        seen[t.name] = i
        dt = _DTYPES.get(t.dtype)
        if dt is None:
            raise BadMessage(f"inputs[{i}].dtype: expected one of {sorted(_DTYPES)}, got {_clip(t.dtype)}", rid)
        if len(t.shape) > P.MAX_DIMS:
            raise BadMessage(f"inputs[{i}].shape: expected at most {P.MAX_DIMS} dimensions, got {len(t.shape)}",
                             rid)
        if not all(0 <= d <= _MAX_DIM for d in t.shape):
            raise BadMessage(f"inputs[{i}].shape: expected dimensions 0..{_MAX_DIM}, got {t.shape}", rid)
        dtypes.append(dt)
        if t.name in images:
            continue
        buf = group[0]
        expected = math.prod(t.shape) * dt.itemsize
        if len(buf) != expected:
            raise BadMessage(f"inputs[{i}]: data frame of {len(buf)} bytes, expected {expected} "
                             f"({t.dtype} of shape {t.shape})", rid)
    return dtypes


def _check_model(req: InlineRequest, models: Mapping[str, ModelPlan], max_items: int,
                 groups: list[list[bytes]]) -> None:
    """Refused with the protocol's code (UNKNOWN_MODEL, BAD_INPUT, BAD_DTYPE, BAD_SHAPE, BAD_SIZE) unless the inputs
    are the model's, with its dtypes and item shapes (images: [N], each of 1..max_bytes bytes) and one row count
    the session and the model take."""
    rid = req.id
    plan = models.get(req.model)
    if plan is None:
        raise Refused(f"model: {_clip(req.model)} is not served; models are {sorted(models)}", rid, "UNKNOWN_MODEL")
    specs = {s.name: k for k, s in enumerate(plan.info.inputs)}
    rows = -1
    for t, group in zip(req.inputs, groups, strict=True):
        k = specs.get(t.name)
        field = f"inputs[{_clip(t.name)}]"
        if k is None:
            raise Refused(f"{field}: model {req.model!r} has no such input; its inputs are {list(specs)}", rid,
                          "BAD_INPUT")
        if t.dtype != plan.in_dtypes[k].name:
            raise Refused(f"{field}.dtype: expected {plan.in_dtypes[k].name}, got {t.dtype}", rid, "BAD_DTYPE")
        spec = plan.info.inputs[k]
        if spec.kind == P.InputKind.IMAGE:
            _check_images(req, spec, field, t.shape, group)
            item: tuple[int, ...] = ()
        else:
            item = plan.in_item_shapes[k]
        if len(t.shape) != len(item) + 1 or tuple(t.shape[1:]) != item:
            raise Refused(f"{field}.shape: expected [N, {', '.join(map(str, item))}], got {t.shape}", rid,
                          "BAD_SHAPE")
        if rows >= 0 and t.shape[0] != rows:
            raise Refused(f"{field}.shape[0]: {t.shape[0]} rows, the first input has {rows}", rid, "BAD_SHAPE")
        rows = t.shape[0]
        try:
            check_rows(plan, rows, f"{field}.shape[0]", max_items, MAX_ITEMS_SETTING)
        except BadInput as exc:
            raise Refused(exc.message, rid, exc.code) from None
    missing = [name for name in specs if not any(t.name == name for t in req.inputs)]
    if missing:
        raise Refused(f"inputs: model {req.model!r} also takes {missing}; its inputs are {list(specs)}", rid,
                      "BAD_INPUT")


def _check_images(req: InlineRequest, spec: P.TensorSpec, field: str, shape: list[int], group: list[bytes]) -> None:
    """An input of encoded images: shape [N], its N frames each an image of 1..max_bytes bytes (BAD_SHAPE,
    BAD_SIZE naming the image and the model's max_image_bytes)."""
    if len(shape) != 1:
        raise Refused(f"{field}.shape: expected [N], N images (model {req.model!r} takes encoded images, one a "
                      f"frame), got {shape}", req.id, "BAD_SHAPE")
    for j, image in enumerate(group):
        if not 1 <= len(image) <= spec.max_bytes:
            raise Refused(f"{field}[{j}]: an image of {len(image)} bytes; model {req.model!r} takes 1.."
                          f"{spec.max_bytes} bytes an image (the broker's models.{req.model}.max_image_bytes)",
                          req.id, "BAD_SIZE")


def _asks_models(frames: list[bytes]) -> bool:
    """An INLINE_MODELS message: answered at once from what the session knows, so never past the cap."""
    return len(frames) == 2 and frames[0] == P.INLINE_MODELS_ENVELOPE  # envelope, {}


def reply_frames(rid: int, status: str, message: str = "", outputs: dict[str, np.ndarray] | None = None) -> list[Any]:
    outs = outputs or {}
    header = InlineReply(rid, status, message,
                         [InlineTensor(n, a.dtype.name, list(a.shape)) for n, a in outs.items()])
    return [P.INLINE_REPLY_ENVELOPE, _ENCODE.encode(header),
            *(np.ascontiguousarray(a).data for a in outs.values())]


def _internal_reply(rid: int, exc: BaseException) -> list[bytes]:
    """The frames of an INTERNAL reply to request ``rid``, a fault of the gateway's; they cannot fail to build."""
    message = f"the gateway failed on this request ({type(exc).__name__}); its log has the details"
    return [P.INLINE_REPLY_ENVELOPE, _ENCODE.encode(InlineReply(rid, "INTERNAL", message))]


def _size(frames: list[bytes]) -> int:
    return sum(len(f) for f in frames)


class Gateway:
    """The inline sockets of one session. Every message received gets exactly one reply (unless ZeroMQ cannot
    deliver it: the caller left, or reads none and its queue is full; both are logged); at most
    ``max_pending`` requests, and ``max_bytes`` of their frames, are held at once, and one more is answered
    OVERLOADED at once."""

    def __init__(self, client: AsyncClient, sockets: list[zmq.asyncio.Socket], max_pending: int,
                 max_bytes: int) -> None:
        self.client = client
        self.sockets = sockets
        self.max_pending = max_pending
        self.max_bytes = max_bytes
        # Requests accepted and not finished: being checked, waiting for a slot, in a slot, or answered TIMEOUT
        # while the worker may still use their slot (PROTOCOL 5.7). What they hold (frames, a slot) is what the
        # caps bound: their count, and the bytes of their frames.
        self.held = 0
        self.held_bytes = 0
        # One slot per request, taken before AsyncClient.infer and given back only once its call is over: so the
        # wait for a slot is the gateway's, whose timeout names --slots, and a submitted call is never cancelled
        # (a late answer still ends it, and its slot is the worker's until then).
        self.slots = asyncio.Semaphore(client.client.segment.layout.n_slots)
        self.tasks: set[asyncio.Task[None]] = set()
        self._undelivered = RateLimitedLog(log)  # a caller that floods and reads nothing would flood the log

    async def run(self, stop: asyncio.Event) -> None:
        """Receive on every socket until ``stop``; then ``drain`` answers what was accepted."""
        await asyncio.gather(*(self._receive(sock, stop) for sock in self.sockets))

    async def _receive(self, sock: zmq.asyncio.Socket, stop: asyncio.Event) -> None:
        waiter = asyncio.ensure_future(stop.wait())
        while not stop.is_set():
            recv = asyncio.ensure_future(sock.recv_multipart())
            await asyncio.wait({recv, waiter}, return_when=asyncio.FIRST_COMPLETED)
            if not recv.done():
                recv.cancel()
                break
            ident, *frames = recv.result()
            size = _size(frames)
            full = self._full(size)
            if full and not _asks_models(frames):
                # answered here, nothing decoded past the id: past the cap a request costs one small reply
                rid = request_id(frames)
                await self._send(sock, ident, rid, "OVERLOADED", reply_frames(rid, "OVERLOADED", full))
                continue
            self.held += 1
            self.held_bytes += size
            task = asyncio.create_task(self._answer(sock, ident, frames, size))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
        waiter.cancel()

    def _full(self, size: int) -> str:
        """Why a request of ``size`` bytes may not be held now ('' when it may)."""
        if self.held >= self.max_pending:
            return (f"the gateway holds {self.held} requests, its limit ({MAX_PENDING_SETTING} {self.max_pending}): "
                    f"try again later, or raise it")
        if self.held_bytes + size > self.max_bytes:
            return (f"the gateway holds {self.held} requests of {self.held_bytes / MIB:.2f} MiB and this one has "
                    f"{size / MIB:.2f} MiB, past its limit ({MAX_PENDING_MIB_SETTING} {self.max_bytes // MIB}): "
                    f"try again later, or raise it")
        return ""

    def _release(self, size: int) -> None:
        self.held -= 1
        self.held_bytes -= size

    async def drain(self, timeout: float) -> None:
        """Wait up to ``timeout`` s for the replies of the requests accepted (after ``client.close``, which
        answers what is left in flight); any still unanswered then are logged."""
        if self.tasks:
            _done, late = await asyncio.wait(set(self.tasks), timeout=timeout)
            if late:
                log.warning("%d requests still unanswered %.0f s after the stop; they get no reply", len(late),
                            timeout)

    async def _answer(self, sock: zmq.asyncio.Socket, ident: bytes, frames: list[bytes], size: int) -> None:
        """One reply to one accepted message of ``size`` bytes, whatever it holds or whatever fails on it;
        ``held`` and ``held_bytes`` drop once nothing of it is left."""
        inner: asyncio.Future[Any] | None = None
        try:
            rid, status, reply, inner = await self._reply(frames)
        except Exception as exc:  # a fault of the gateway's must cost neither this reply nor the receive loop
            rid = request_id(frames)
            log.exception("request %d: the gateway failed on it", rid)
            status, reply = "INTERNAL", _internal_reply(rid, exc)
        try:
            await self._send(sock, ident, rid, status, reply)
        finally:
            if inner is None:
                self._release(size)
            else:
                inner.add_done_callback(lambda f: self._inner_over(f, size))

    async def _reply(self, frames: list[bytes]) -> tuple[int, str, list[Any], asyncio.Future[Any] | None]:
        """The id, status and frames of a message's reply, and the session call when it is still running."""
        if _asks_models(frames):
            answer = InlineModelsReply([p.info for p in self.client.models.values()], rows_limit(self.client.models))
            return 0, "OK", [P.INLINE_MODELS_REPLY_ENVELOPE, _ENCODE.encode(answer)], None
        try:
            req, arrays = decode_request(frames, self.client.models, rows_limit(self.client.models))
        except Refused as exc:
            return exc.rid, exc.code, reply_frames(exc.rid, exc.code, str(exc)), None
        try:
            reply, status, inner = await self._infer(req, arrays)
        except ShmBrokerError as exc:
            return req.id, exc.code, reply_frames(req.id, exc.code, exc.message), None
        return req.id, status, reply, inner

    async def _infer(self, req: InlineRequest,
                     arrays: dict[str, np.ndarray] | list[bytes]) -> tuple[list[Any], str, asyncio.Future[Any] | None]:
        """The reply, its status, and the session call when it is still running. A request not answered within
        its timeout (from its arrival: the wait for a slot counts) plus GRACE_S is answered TIMEOUT, and its call
        goes on until the worker answers or dies, holding its slot, as the worker may still use it (PROTOCOL 5.7)."""
        plan = self.client.models[req.model]  # decode_request checked it is served
        timeout = req.timeout_us / 1e6 if req.timeout_us else plan.info.timeout_ms / 1e3
        loop = asyncio.get_running_loop()
        start = loop.time()
        try:
            async with asyncio.timeout(timeout):
                await self.slots.acquire()
        except TimeoutError:
            raise RequestTimeout(f"no free slot within {timeout:g} s: all {self.client.client.segment.layout.n_slots} "
                                 f"slots of the gateway's session are in flight (raise shmbroker inline --slots, "
                                 f"or timeout_us)") from None
        left = timeout - (loop.time() - start)
        if left <= 0:
            self.slots.release()
            raise RequestTimeout(f"no free slot within {timeout:g} s")
        inner = asyncio.ensure_future(self.client.infer(req.model, arrays, left))
        inner.add_done_callback(lambda _f: self.slots.release())
        await asyncio.wait({inner}, timeout=left + GRACE_S)
        if not inner.done():
            return reply_frames(req.id, "TIMEOUT", f"no answer from the worker within {timeout + GRACE_S:g} s "
                                f"(timeout_us, else the model's timeout_ms, plus {GRACE_S:g} s)"), "TIMEOUT", inner
        out = inner.result()
        outs = out if isinstance(out, dict) else {plan.info.outputs[0].name: out}
        return reply_frames(req.id, "OK", "", outs), "OK", None

    def _inner_over(self, inner: asyncio.Future[Any], size: int) -> None:
        """A call answered TIMEOUT has ended: its slot is free; its result, already replied for, is dropped."""
        self._release(size)
        if not inner.cancelled() and inner.exception() is not None:
            log.debug("a request answered TIMEOUT ended later with %s", inner.exception())

    async def _send(self, sock: zmq.asyncio.Socket, ident: bytes, rid: int, status: str, reply: list[Any]) -> None:
        """Send without waiting: ROUTER_MANDATORY makes a reply ZeroMQ cannot deliver an error, logged here, where
        a ROUTER would otherwise drop it without a word. A reply whose frames cannot be sent (a fault of the
        gateway's) is replaced by an INTERNAL one, which can, so the caller still gets its one reply."""
        try:
            await sock.send_multipart([ident, *reply], flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            self._undelivered.warning("request %d: %s reply dropped: the caller's queue is full (it reads no "
                                      "replies)", rid, status)
        except zmq.ZMQError as exc:  # EHOSTUNREACH: the caller disconnected before its answer
            self._undelivered.warning("request %d: %s reply not delivered: %s", rid, status, exc)
        except Exception as exc:
            if status == "INTERNAL":
                raise  # _internal_reply's frames are bytes; this is past recovery
            log.exception("request %d: its %s reply could not be sent", rid, status)
            await self._send(sock, ident, rid, "INTERNAL", _internal_reply(rid, exc))


class GatewayRefused(RuntimeError):
    """The gateway may not take its socket (another gateway serves it, or the runtime directory is missing);
    the text names the path and the setting to change."""


class SocketClaim(UnixClaim):
    """This gateway's hold on ``<runtime_dir>/inline.sock`` through ``inline.lock`` (frontend.unixclaim);
    GatewayRefused when a live gateway holds it, or the runtime directory is missing."""

    def __init__(self, runtime_dir: Path) -> None:
        path = runtime_dir / SOCKET_NAME
        try:
            super().__init__(path, runtime_dir / LOCK_NAME, lambda holder: GatewayRefused(
                f"{path}: another `shmbroker inline` (pid {holder}) already serves it; stop that one, or give this "
                f"one another runtime directory (--runtime-dir or $SHMBROKER_RUNTIME_DIR)"))
        except FileNotFoundError:
            raise GatewayRefused(f"runtime directory {runtime_dir} does not exist: start `shmbroker serve` "
                                 f"first, or name the broker's with --runtime-dir or $SHMBROKER_RUNTIME_DIR") from None


async def _connect(rd: Path, args: argparse.Namespace, stop: asyncio.Event) -> AsyncClient | None:
    """The ring session, retried until the broker answers (it may start after the gateway)."""
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        try:
            client = await loop.run_in_executor(None, lambda: AsyncClient(
                rd, slots=args.slots, max_items=args.max_items, name="inline-gateway"))
            client.client.max_items_setting = MAX_ITEMS_SETTING
            client.client.slots_setting = SLOTS_SETTING
            return client
        except ShmBrokerError as exc:
            log.warning("no session with the broker on %s yet (%s); retrying", rd, exc)
            try:
                await asyncio.wait_for(stop.wait(), 1.0)
            except TimeoutError:
                continue
    return None


def _router(ctx: zmq.asyncio.Context, max_bytes: int) -> zmq.asyncio.Socket:
    """A ROUTER for callers: a reply it cannot deliver is an error to log (ROUTER_MANDATORY), not a silent drop;
    a frame over ``max_bytes`` drops its caller's connection before it is allocated (MAXMSGSIZE), as no request
    holding it could be taken anyway."""
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, SHUTDOWN_LINGER_MS)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)
    return sock


def _tcp_socket(ctx: zmq.asyncio.Context, args: argparse.Namespace) -> zmq.asyncio.Socket:
    """The TCP ROUTER: CURVE server with the secret key of --curve-secret-file (Z85, 40 characters; the command
    checked the file's mode and the key's length)."""
    secret = Path(args.curve_secret_file).read_bytes().strip()
    sock = _router(ctx, args.max_pending_mib * MIB)
    sock.curve_server = True
    sock.curve_secretkey = secret
    sock.curve_publickey = zmq.curve_public(secret)
    sock.bind(args.tcp)
    return sock


async def serve(args: argparse.Namespace, on_ready: Callable[[list[str]], None]) -> int:
    """Serve until SIGTERM or SIGINT, then answer what was accepted before exiting; GatewayRefused, before
    anything is bound, when a gateway already serves the runtime directory or it does not exist."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    rd = Path(args.runtime_dir) if args.runtime_dir else runtime.resolve()
    claim = SocketClaim(rd)
    ctx = zmq.asyncio.Context()
    auth = None
    try:
        if args.tcp and args.curve_clients:
            from zmq.auth.asyncio import AsyncioAuthenticator

            auth = AsyncioAuthenticator(ctx)  # ZAP: only the public keys in the directory may connect over TCP
            auth.start()
            auth.configure_curve(domain="*", location=args.curve_clients)
            keys = len(auth.certs.get("*", {}))
            log.log(logging.INFO if keys else logging.WARNING, "--tcp %s: the public keys in --curve-clients %s may "
                    "connect (%d%s)", args.tcp, args.curve_clients, keys, "" if keys else ": no caller can")
        elif args.tcp:  # --curve-any-client: the command refuses --tcp with neither
            log.warning("--tcp %s with --curve-any-client: any caller that knows this server's public key is "
                        "served, with any key pair; name the callers' public keys with --curve-clients DIR instead "
                        "(docs/DEPLOY.md)", args.tcp)
        ipc = _router(ctx, args.max_pending_mib * MIB)
        endpoints = [runtime.endpoint(rd, SOCKET_NAME)]
        ipc.bind(endpoints[0])
        claim.bound()
        sockets = [ipc]
        if args.tcp:
            sockets.append(_tcp_socket(ctx, args))
            endpoints.append(str(sockets[-1].getsockopt_string(zmq.LAST_ENDPOINT)))  # tcp://HOST:* resolved
        client = await _connect(rd, args, stop)
        if client is not None:
            on_ready(endpoints)
            gateway = Gateway(client, sockets, args.max_pending, args.max_pending_mib * MIB)
            await gateway.run(stop)
            await client.close()  # requests in flight get CLOSE_WAIT_S; the rest end CLIENT_CLOSED ...
            await gateway.drain(DRAIN_S)  # ... and each accepted request gets its reply
    finally:
        if auth is not None:
            auth.stop()
        ctx.destroy(linger=SHUTDOWN_LINGER_MS)  # the replies just sent still go out
        claim.release()  # after the close: the file goes only once nothing of ours listens on it
    return 0
