"""One Ray Serve replica's work (``NodeBroker``): a client of the broker on its own node.

The replica finds its node's broker as any client does: ``runtime_dir`` when given, else $SHMBROKER_RUNTIME_DIR
in the environment that the node's ``ray start`` hands to its workers, else the default directory. It waits for
that broker to be ready, then holds one ``AsyncClient`` session, so the tensors go from the Ray request into a
ring slot and back with no other socket on the node. The session outlives a broker restart (client.rejoin);
meanwhile ``check_health`` fails, Ray Serve stops routing here and replaces the replica, whose successor waits
for the broker and takes traffic again once it is ready.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import ray

from shmbroker.broker.common import protocol as P
from shmbroker.broker.common import runtime
from shmbroker.broker.common.ask import NoAnswer, PatientAsk, ask_broker
from shmbroker.client import AsyncClient, NoBroker, RequestError, RequestTimeout, ShmBrokerError
from shmbroker.client.client import Inputs, Outputs
from shmbroker.ray.http import respond

if TYPE_CHECKING:
    from starlette.requests import Request
    from starlette.responses import Response

log = logging.getLogger(__name__)
DEFAULT_SLOTS = 64  # requests in flight from one replica to its broker; more wait for a slot (AsyncClient)
STARTUP_WAIT_S = 60.0  # how long a new replica waits for its node's broker to be ready before Serve retries it
HEALTH_ASK_S = 2.0  # how long check_health waits for the broker's HEALTH answer


class BrokerNotReady(Exception):
    """The node's broker is gone, does not answer, or is not ready: Ray Serve takes the replica out of routing."""


@dataclass(frozen=True)
class Call:
    """One request of a coalesced Ray call (``NodeBroker.infer_many``). ``deadline``: the ``time.time()`` by
    which it must be answered, wall-clock because it crosses machines; None: the model's own timeout."""

    model: str
    inputs: Inputs
    deadline: float | None = None


def time_left(timeout: float | None, deadline: float | None, node: str) -> float | None:
    """The broker's timeout for a request: what is left of ``deadline`` (at most ``timeout``); RequestTimeout when
    nothing is left, the request having spent it in Ray before it reached the node."""
    if deadline is None:
        return timeout
    left = deadline - time.time()
    if left <= 0:
        raise RequestTimeout(f"the request's deadline passed {-left:.3f} s before it reached the broker of node "
                             f"{node} (in Ray's queues or transit); nothing was run")
    return left if timeout is None else min(left, timeout)


def wait_ready(runtime_dir: Path, wait_s: float) -> None:
    """Block until the broker on ``runtime_dir`` answers HEALTH ready (it may be starting or restarting);
    NoBroker naming the directory and ``startup_wait_s`` when it is not within ``wait_s``."""
    deadline = time.monotonic() + wait_s
    try:
        with PatientAsk(runtime_dir) as ask:
            reply = ask.ask(lambda left: P.Health(max(1, int(left * 1000))), deadline,
                            again=lambda r: isinstance(r, P.HealthReply) and not r.ready)
    except NoAnswer as exc:
        raise NoBroker(f"no broker answered on {runtime_dir} within {wait_s:g} s ({exc}): start `shmbroker serve` "
                       "on this node, set $SHMBROKER_RUNTIME_DIR for its `ray start`, or raise startup_wait_s"
                       ) from None
    if not isinstance(reply, P.HealthReply) or not reply.ready:
        why = reply.reason if isinstance(reply, P.HealthReply) else f"it answered {type(reply).__name__}"
        raise NoBroker(f"the broker on {runtime_dir} was not ready within {wait_s:g} s ({why}); raise startup_wait_s")


class NodeBroker:
    """The replica: ``infer`` one request (numpy in, numpy out), ``infer_many`` a coalesced call, ``__call__`` the
    KServe v2 HTTP protocol, ``check_health`` the broker's readiness. Errors are the client's typed ones.

    ``runtime_dir``: the broker's directory on every node (None: each node's own, see the module docstring);
    ``slots`` and ``max_items``: the session's, as ``AsyncClient``; ``startup_wait_s``: how long the constructor
    waits for the broker to be ready (Ray Serve retries a replica whose constructor fails).
    """

    def __init__(self, runtime_dir: str | None = None, slots: int = DEFAULT_SLOTS, max_items: int = 0,
                 startup_wait_s: float = STARTUP_WAIT_S) -> None:
        self.runtime_dir = Path(runtime_dir) if runtime_dir else runtime.resolve()
        self.node_id: str = ray.get_runtime_context().get_node_id()
        wait_ready(self.runtime_dir, startup_wait_s)
        self.client = AsyncClient(self.runtime_dir, slots=slots, max_items=max_items,
                                  name=f"ray-{self.node_id[:12]}-{os.getpid()}")
        self.client.client.slots_setting = "NodeBroker(slots=...)"
        self.client.client.max_items_setting = "NodeBroker(max_items=...)"
        log.info("replica on node %s: session with the broker on %s, models %s", self.node_id, self.runtime_dir,
                 sorted(self.client.models))

    async def infer(self, model: str, inputs: Inputs, timeout: float | None = None,
                    deadline: float | None = None) -> Outputs:
        """One request through the node's broker, within ``timeout`` s of its arrival here and by ``deadline``
        (``time.time()``); raises the client's typed errors (RayTaskError instances of them, for the caller)."""
        return await self.client.infer(model, inputs, time_left(timeout, deadline, self.node_id))

    async def infer_many(self, calls: list[Call]) -> list[Outputs | ShmBrokerError]:
        """A coalesced Ray call (``BrokerHandle``): every request at once, each answer or typed error in order."""
        return list(await asyncio.gather(*(self._answer(c) for c in calls)))

    async def _answer(self, call: Call) -> Outputs | ShmBrokerError:
        try:
            return await self.infer(call.model, call.inputs, deadline=call.deadline)
        except ShmBrokerError as exc:
            return exc
        except Exception as exc:  # one request's surprise must not fail the others of its call
            log.exception("request for model %r failed", call.model)
            return RequestError(f"the replica on node {self.node_id} failed: {exc!r}")

    async def __call__(self, request: Request) -> Response:
        """Ray Serve's HTTP proxy hands every HTTP request here: KServe v2, as the HTTP front-end speaks it."""
        return await respond(self, request)

    async def check_health(self) -> None:
        """Ray Serve's health check: BrokerNotReady while the broker is gone or not ready (a worker down, say)."""
        why, _reply = await self.health()
        if why:
            raise BrokerNotReady(why)

    async def health(self) -> tuple[str, P.HealthReply | None]:
        """Why the node's broker cannot serve ("" when it is ready), and its HEALTH answer when it gave one."""
        if not self.client.client.connected:
            return f"node {self.node_id}: the broker on {self.runtime_dir} is gone (stopped or restarting)", None
        reply = await asyncio.get_running_loop().run_in_executor(None, ask_broker, self.runtime_dir, P.Health(0),
                                                                 HEALTH_ASK_S)
        if not isinstance(reply, P.HealthReply):
            return f"node {self.node_id}: the broker on {self.runtime_dir} does not answer", None
        if not reply.ready:
            return f"node {self.node_id}: the broker on {self.runtime_dir} is not ready: {reply.reason}", reply
        return "", reply

    def __del__(self) -> None:
        """Ray Serve's shutdown of the replica: end the session (requests in flight get CLOSE_WAIT_S)."""
        client = getattr(self, "client", None)
        if client is not None:
            client.client.close()
