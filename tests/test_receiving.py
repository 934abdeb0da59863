"""client.receiving: one DONE message completes each of its requests exactly once, with its own outcome.

A real broker serves the session, but the SUBMITs are kept from the worker (the link's push socket is
replaced by a recorder), so the DONE below is the only answer these requests get: it is crafted as a
worker could send it, and fed to the client's handler for reply messages.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from broker import protocol as P
from client import Client, RequestTimeout, ShmBrokerError
from tests.conftest import RunningBroker

Outcome = tuple[object, ShmBrokerError | None]


class _Recorder:
    def __init__(self) -> None:
        self.sent: list[list[bytes]] = []

    def send_multipart(self, frames: list[bytes]) -> None:
        self.sent.append(frames)


def test_a_done_mixing_ok_and_error_answers_each_request_once_even_when_a_callback_reuses_a_slot(
        broker: RunningBroker) -> None:
    x = np.zeros((1, 256), np.float32)
    with Client() as c:
        link = c._link_list[0]
        real_push, link.push = link.push, _Recorder()  # type: ignore[assignment]
        got: dict[int, list[Outcome]] = {}

        def on_done(i: int) -> Callable[[object, ShmBrokerError | None], None]:
            def done(out: object, err: ShmBrokerError | None) -> None:
                got.setdefault(i, []).append((out, err))
                if i == 0:  # submits at once, into the slot this answer just freed (the free list is LIFO)
                    c.call("tiny", x, on_done(3))
            return done

        for i in range(3):
            c.call("tiny", x, on_done(i))
        first = sorted(c._pending.items(), key=lambda sp: sp[1].request_id)
        (s0, p0), (s1, p1), (s2, p2) = first
        mid = p0.plan.info.model_id
        for k, slot in ((1, s0), (3, s2)):  # what the worker would have written: request k's output is all k
            views = c._views[mid][slot]
            assert views is not None
            views.outs[0][...] = k
        lay = p0.layout
        frames = P.encode_done(P.DoneBatch(c.session_id, [
            P.Result(p0.request_id, s0, p0.generation, P.Status.OK, list(lay.out_descs)),
            P.Result(p1.request_id, s1, p1.generation, P.Status.TIMEOUT, [], "deadline passed"),
            P.Result(p2.request_id, s2, p2.generation, P.Status.OK, list(lay.out_descs)),
        ]))
        with c._role.exclusive():
            c._on_done_message(link, frames)
            c._on_done_message(link, frames)  # a repeat: none of its requests is in flight any more
        assert sorted(got) == [0, 1, 2]
        assert all(len(v) == 1 for v in got.values()), got
        out0, err0 = got[0][0]
        assert err0 is None and isinstance(out0, np.ndarray) and np.all(out0 == 1)
        assert got[1][0][0] is None and isinstance(got[1][0][1], RequestTimeout)
        out2, err2 = got[2][0]
        assert err2 is None and isinstance(out2, np.ndarray) and np.all(out2 == 3)
        # the request submitted from the first callback took slot s0 and is still waiting for its answer
        assert 3 not in got
        assert list(c._pending) == [s0] and c._pending[s0].request_id > p2.request_id
        assert link.outstanding == 1
        link.push = real_push
