"""A protocol-level client for tests: the real handshake and sockets, but every SUBMIT is crafted by hand.

It plays the part a C client or a hostile peer would: nothing in it checks inputs before sending.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import zmq

from shmbroker.broker.common import protocol as P
from shmbroker.broker.common.protocol import SlotState
from shmbroker.client.links import Link
from shmbroker.client.session import ModelPlan, control_socket, handshake


class RawClient:
    def __init__(self, runtime_dir: Path, slots: int = 8, max_items: int = 4) -> None:
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.ctl = control_socket(self.ctx, runtime_dir)
        hs = handshake(self.ctl, runtime_dir, slots, max_items, "raw", 20.0)
        self.setup = hs.setup
        self.token = hs.ready.token
        self.segment = hs.segment
        self.session_id = hs.setup.session_id
        self.models = {m.name: ModelPlan.of(m) for m in hs.setup.models}
        self.link = Link(self.ctx, hs.ready.workers[0])
        end = time.monotonic() + 10
        while not self.link.handshake_done() and time.monotonic() < end:
            self.link.monitor.poll(100)
        self.gens = [0] * hs.setup.n_slots
        self._rid = 0

    def prepare(self, slot: int, model: str, x: np.ndarray, hint: bool = False) -> P.SubmitRequest:
        """Write ``x`` into the slot, publish it SUBMITTED with a new generation; return a correct request.

        ``hint``: also copy the request into the slot header for the worker (PROTOCOL 4.2), as the Python
        client does."""
        plan = self.models[model]
        self.segment.input_view(slot, 0, x.dtype, x.shape)[...] = x
        self.gens[slot] += 1
        self._rid += 1
        desc = P.TensorDesc(0, P.dtype_code(x.dtype), 0, x.nbytes, x.shape)
        req = P.SubmitRequest(self._rid, slot, self.gens[slot], plan.info.model_id, 0, [desc])
        if hint:
            self.segment.post_request(slot, self.link.worker_id, req.request_id, req.generation, req.model_id, 1, 0,
                                      P.pack_tensor(desc))
        else:
            self.segment.publish_slot(slot, SlotState.SUBMITTED, self.gens[slot], self._rid, 0)
        return req

    def send(self, *reqs: P.SubmitRequest, token: int | None = None, session_id: int | None = None) -> None:
        batch = P.SubmitBatch(session_id or self.session_id, self.token if token is None else token, list(reqs))
        self.link.push.send_multipart(P.encode_submit(batch))

    def send_frames(self, frames: list[bytes]) -> None:
        self.link.push.send_multipart(frames)

    def recv(self, timeout: float = 20.0) -> list[P.Result] | None:
        if not self.link.pull.poll(int(timeout * 1000)):
            return None
        frames = self.link.pull.recv_multipart()
        if P.read_envelope(frames) != P.MsgKind.DONE:
            raise AssertionError("reply socket carried something other than DONE")
        return P.decode_done(frames[1]).results

    def output(self, r: P.Result, model: str) -> np.ndarray:
        plan = self.models[model]
        t = r.tensors[0]
        return self.segment.output_view(r.slot, t.offset, plan.out_dtypes[t.index], t.shape).copy()

    def close(self) -> None:
        self.ctl.send_multipart(P.encode(P.Bye(self.session_id)))
        self.link.close()
        self.ctx.destroy(linger=500)
        self.segment.close()
