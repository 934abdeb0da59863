"""``shmbroker inline``: the inline gateway, for callers that cannot map shared memory. Tensor bytes travel in frames.

A caller's DEALER sends ``[envelope(INLINE_REQUEST), JSON header, one frame per input]`` to this process's
ROUTER; the gateway, a ring client of the broker like the HTTP front-end (one ``AsyncClient`` session),
copies the frames into a ring slot, and answers ``[envelope(INLINE_REPLY), JSON header, one frame per
output]``. The shared-memory fast path is untouched: workers and the broker see an ordinary session.
Endpoints: ``ipc://<runtime_dir>/inline.sock`` always; ``tcp://...`` only with ``--tcp`` and then only
with CURVE (``--curve-secret-file``; ``--curve-clients DIR`` limits callers to the public keys in DIR).
One gateway per runtime directory: it holds an flock on ``inline.lock`` beside its socket for its whole life,
so a second one refuses to start, and on exit it removes its socket file if that is still the one it bound.
docs/PROTOCOL.md section 10 has the bytes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import logging
import math
import os
import signal
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import zmq
import zmq.asyncio

from broker import protocol as P
from broker import runtime
from client import AsyncClient, ShmBrokerError

log = logging.getLogger(__name__)
INLINE_REQUEST = 40  # kinds of the inline socket only; the envelope is the protocol's <u16 version, u16 kind>
INLINE_REPLY = 41
INLINE_MODELS = 42  # body {}: what the gateway serves
INLINE_MODELS_REPLY = 43  # body InlineModelsReply: the models SETUP carries and the gateway's rows limit
SOCKET_NAME = "inline.sock"
LOCK_NAME = "inline.lock"  # not *.sock: the broker's stale-socket cleanup leaves it alone, and it is never unlinked
MAX_ITEMS_SETTING = "shmbroker inline --max-items"  # what a BAD_SHAPE answer over the session's rows names


class InlineTensor(msgspec.Struct, frozen=True):
    name: str
    dtype: str  # numpy name, as in TensorSpec
    shape: list[int]


class InlineRequest(msgspec.Struct, frozen=True):
    id: int
    model: str
    inputs: list[InlineTensor]
    timeout_us: int = 0  # 0: the model's timeout_ms


class InlineReply(msgspec.Struct, frozen=True):
    id: int
    status: str  # "OK" or the protocol's code (BAD_INPUT, OVERLOADED, TIMEOUT, UNKNOWN_MODEL, ..., BAD_MESSAGE)
    message: str = ""
    outputs: list[InlineTensor] = []


class InlineModelsReply(msgspec.Struct, frozen=True):
    """What the gateway serves: ``max_items`` is its session's rows limit, so a request may have
    ``min(max_items, model.max_batch)`` rows."""

    models: list[P.ModelInfo]
    max_items: int


class _RequestId(msgspec.Struct):
    """The id alone, read from a header that fails InlineRequest's schema, so that the answer still names it."""

    id: int


_DECODE = msgspec.json.Decoder(InlineRequest)
_DECODE_ID = msgspec.json.Decoder(_RequestId)
_ENCODE = msgspec.json.Encoder()


class BadMessage(ValueError):
    """An inline request that does not follow section 10; the text names the part, ``rid`` is the request's id
    (0 when none could be read)."""

    def __init__(self, message: str, rid: int = 0) -> None:
        super().__init__(message)
        self.rid = rid


def _header_id(header: bytes) -> int:
    """The header's integer ``id`` when it has one, even if the rest of it is wrong; else 0."""
    try:
        return _DECODE_ID.decode(header).id
    except msgspec.DecodeError:
        return 0


def decode_request(frames: list[bytes]) -> tuple[InlineRequest, dict[str, np.ndarray]]:
    """The header and the input arrays (views of the frames, no copy); BadMessage names what is wrong and, once
    the header's id could be read, carries it."""
    if len(frames) < 2 or len(frames[0]) != P.ENVELOPE.size:
        raise BadMessage(f"expected [envelope (4 bytes), JSON header, one frame per input], got {len(frames)} frames")
    version, kind = P.ENVELOPE.unpack(frames[0])
    if version != P.PROTOCOL_VERSION or kind != INLINE_REQUEST:
        raise BadMessage(f"envelope: expected version {P.PROTOCOL_VERSION} kind {INLINE_REQUEST}, got {version} {kind}")
    try:
        req = _DECODE.decode(frames[1])
    except msgspec.DecodeError as exc:
        raise BadMessage(f"header: {exc}", _header_id(frames[1])) from None
    data = frames[2:]
    if len(data) != len(req.inputs):
        raise BadMessage(f"header names {len(req.inputs)} inputs, {len(data)} data frames follow", req.id)
    arrays: dict[str, np.ndarray] = {}
    for i, (t, buf) in enumerate(zip(req.inputs, data, strict=True)):
        try:
            dt = np.dtype(t.dtype)
            P.dtype_code(dt)
        except (TypeError, P.ProtocolError):
            raise BadMessage(f"inputs[{i}].dtype: expected a numpy name such as 'float32', got {t.dtype!r}",
                             req.id) from None
        if any(d < 0 for d in t.shape) or len(buf) != math.prod(t.shape) * dt.itemsize:
            raise BadMessage(f"inputs[{i}]: data frame {len(buf)} bytes, expected {math.prod(t.shape)} x "
                             f"{dt.itemsize} for shape {t.shape}", req.id)
        arrays[t.name] = np.frombuffer(buf, dt).reshape(t.shape)
    return req, arrays


def reply_frames(rid: int, status: str, message: str = "", outputs: dict[str, np.ndarray] | None = None) -> list[Any]:
    outs = outputs or {}
    header = InlineReply(rid, status, message,
                         [InlineTensor(n, a.dtype.name, list(a.shape)) for n, a in outs.items()])
    return [P.ENVELOPE.pack(P.PROTOCOL_VERSION, INLINE_REPLY), _ENCODE.encode(header),
            *(np.ascontiguousarray(a).data for a in outs.values())]


class Gateway:
    def __init__(self, client: AsyncClient, sock: zmq.asyncio.Socket) -> None:
        self.client = client
        self.sock = sock
        self.tasks: set[asyncio.Task[None]] = set()

    async def handle(self, ident: bytes, frames: list[bytes]) -> None:
        if len(frames) == 2 and frames[0] == P.ENVELOPE.pack(P.PROTOCOL_VERSION, INLINE_MODELS):
            answer = InlineModelsReply([p.info for p in self.client.models.values()], self.client.client.max_items)
            await self.sock.send_multipart([ident, P.ENVELOPE.pack(P.PROTOCOL_VERSION, INLINE_MODELS_REPLY),
                                            _ENCODE.encode(answer)])
            return
        rid = 0  # until the header is read
        try:
            req, arrays = decode_request(frames)
            rid = req.id
            timeout = req.timeout_us / 1e6 if req.timeout_us > 0 else None
            out = await self.client.infer(req.model, arrays, timeout)
            plan = self.client.models[req.model]
            outs = out if isinstance(out, dict) else {plan.info.outputs[0].name: out}
            reply = reply_frames(rid, "OK", "", outs)
        except BadMessage as exc:
            reply = reply_frames(exc.rid, "BAD_MESSAGE", str(exc))
        except ShmBrokerError as exc:
            reply = reply_frames(rid, exc.code, exc.message)
        await self.sock.send_multipart([ident, *reply], copy=False)

    async def run(self, stop: asyncio.Event) -> None:
        waiter = asyncio.ensure_future(stop.wait())
        while not stop.is_set():
            recv = asyncio.ensure_future(self.sock.recv_multipart())
            await asyncio.wait({recv, waiter}, return_when=asyncio.FIRST_COMPLETED)
            if not recv.done():
                recv.cancel()
                break
            ident, *frames = recv.result()
            task = asyncio.create_task(self.handle(ident, frames))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
        waiter.cancel()


class GatewayRefused(RuntimeError):
    """The gateway may not take its socket (another gateway serves it, or the runtime directory is missing);
    the text names the path and the setting to change."""


class SocketClaim:
    """This gateway's hold on ``<runtime_dir>/inline.sock``: an flock on ``inline.lock``, taken before the bind
    and kept until after the socket file is removed; GatewayRefused when a live gateway holds it."""

    # An flock rather than a connect probe of the socket: two gateways starting at once cannot both see the
    # file free, and the kernel drops the lock of a gateway that dies, so a stale socket file never blocks.
    def __init__(self, runtime_dir: Path) -> None:
        self.path = runtime_dir / SOCKET_NAME
        self._bound: tuple[int, int] | None = None  # (st_dev, st_ino) of the file our bind created
        lock = runtime_dir / LOCK_NAME
        try:
            self._fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
        except FileNotFoundError:
            raise GatewayRefused(f"runtime directory {runtime_dir} does not exist: start `shmbroker serve` "
                                 f"first, or name the broker's with --runtime-dir or $SHMBROKER_RUNTIME_DIR") from None
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self._fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(self._fd)
            raise GatewayRefused(f"{self.path}: another `shmbroker inline` (pid {holder}) already serves it; "
                                 f"stop that one, or give this one another runtime directory (--runtime-dir or "
                                 f"$SHMBROKER_RUNTIME_DIR)") from None
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"{os.getpid()}\n".encode(), 0)  # for the message of a gateway refused later

    def bound(self) -> None:
        """Record the socket file that our bind just created (ZeroMQ replaced any stale one: we hold the lock)."""
        st = self.path.stat()
        self._bound = (st.st_dev, st.st_ino)

    def release(self) -> None:
        """Remove our socket file if it is still ours (never another's put there since), then drop the lock."""
        with contextlib.suppress(FileNotFoundError):
            st = self.path.stat()
            if (st.st_dev, st.st_ino) == self._bound:
                self.path.unlink()
        os.close(self._fd)


async def _connect(rd: Path, args: argparse.Namespace, stop: asyncio.Event) -> AsyncClient | None:
    """The ring session, retried until the broker answers (it may start after the gateway)."""
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        try:
            client = await loop.run_in_executor(None, lambda: AsyncClient(
                rd, slots=args.slots, max_items=args.max_items, name="inline-gateway"))
            client.client.max_items_setting = MAX_ITEMS_SETTING
            return client
        except ShmBrokerError as exc:
            log.warning("no session with the broker on %s yet (%s); retrying", rd, exc)
            try:
                await asyncio.wait_for(stop.wait(), 1.0)
            except TimeoutError:
                continue
    return None


def _tcp_socket(ctx: zmq.asyncio.Context, args: argparse.Namespace) -> zmq.asyncio.Socket:
    """The TCP ROUTER: CURVE server with the secret key of --curve-secret-file (Z85, 40 characters)."""
    secret = Path(args.curve_secret_file).read_bytes().strip()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.curve_server = True
    sock.curve_secretkey = secret
    sock.curve_publickey = zmq.curve_public(secret)
    sock.bind(args.tcp)
    return sock


async def serve(args: argparse.Namespace, on_ready: Any) -> int:
    """Serve until SIGTERM or SIGINT; GatewayRefused, before anything is bound, when a gateway already serves the
    runtime directory or it does not exist."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    rd = Path(args.runtime_dir) if args.runtime_dir else runtime.resolve()
    claim = SocketClaim(rd)
    ctx = zmq.asyncio.Context()
    auth = None
    try:
        if args.curve_clients:
            from zmq.auth.asyncio import AsyncioAuthenticator

            auth = AsyncioAuthenticator(ctx)  # ZAP: only the public keys in the directory may connect over TCP
            auth.start()
            auth.configure_curve(domain="*", location=args.curve_clients)
        ipc = ctx.socket(zmq.ROUTER)
        ipc.setsockopt(zmq.LINGER, 0)
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
            await asyncio.gather(*(Gateway(client, s).run(stop) for s in sockets))
            await client.close()
    finally:
        if auth is not None:
            auth.stop()
        ctx.destroy(linger=0)
        claim.release()  # after the close: the file goes only once nothing of ours listens on it
    return 0
