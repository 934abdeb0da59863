"""Zero-copy requests: a held slot whose input views the caller fills and whose outputs it reads in place."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np

from shmbroker.broker.common import protocol as P
from shmbroker.broker.common.ring import Segment
from shmbroker.client.errors import ShmBrokerError, from_status
from shmbroker.client.session import ModelPlan

Outputs = np.ndarray | dict[str, np.ndarray]
Callback = Callable[[Outputs | None, ShmBrokerError | None], object]


@dataclass(frozen=True)
class HeldSlot:
    """What a Request does through its client; each sends the held slot as it is (client.client)."""

    run: Callable[[Callable[[], None]], P.Result | ShmBrokerError]  # wait for the answer; call the argument
    # when it comes, even after run() gave up waiting
    submit: Callable[[], Future[Outputs]]  # the Future of the outputs, copied out; the slot freed once answered
    call: Callable[[Callback], None]  # the callback gets the outputs, copied out; the slot freed once answered
    free: Callable[[], None]  # give the slot back


class _EndedInputs(dict[str, np.ndarray]):
    """``req.inputs`` once the block has ended: empty, and a lookup says why instead of a bare KeyError."""

    def __missing__(self, name: str) -> np.ndarray:
        raise ShmBrokerError(f"req.inputs[{name!r}]: the request's `with` block has ended and its slot serves "
                             "other requests now; fill the inputs inside the block", "REQUEST_ENDED")


class Request:
    """A held slot for zero-copy use: write ``inputs`` in place, then ``run()`` and read the outputs in place, or
    ``submit()`` or ``call(callback)`` and take them, copied, from the Future or the callback.

    Every view is valid inside the ``with c.request(...)`` block only. NumPy cannot revoke a view, so arrays kept
    past the block still read the slot, which the next request to take it overwrites: copy what you keep. At the
    end of the block the arrays handed out (``inputs[name]`` and ``run()``'s outputs) are made read-only, so a
    kept one cannot write into another request's slot (views the caller sliced from them are not reached).
    """

    def __init__(self, plan: ModelPlan, slot: int, segment: Segment, held: HeldSlot,
                 ins: Sequence[np.ndarray]) -> None:
        """``ins``: the slot's input views for this row count (the client's, which it copies through; this
        request hands out views of them, its own to freeze)."""
        self._plan = plan
        self._slot = slot
        self._segment = segment
        self._held = held
        self._ended = False
        self.in_flight = False
        self.submitted = False  # the slot is the request's until answered: the block's end does not free it
        # a run() that gave up waiting leaves the slot to whichever comes last, its answer or the block's end
        self._lock = threading.Lock()
        self._answered = False  # the last run()'s answer has come
        self._abandoned = False  # the block has ended with that answer still to come
        self.inputs: dict[str, np.ndarray] = {s.name: v.view() for s, v in zip(plan.info.inputs, ins, strict=True)}
        self._handed: list[np.ndarray] = list(self.inputs.values())  # frozen at the end of the block
        self.outputs: dict[str, np.ndarray] = {}

    def run(self) -> Outputs:
        """Send the slot as it is and wait; the outputs are read-only views into the slot (no copy), valid inside
        the ``with`` block only: they change when a later request reuses the slot."""
        self._check_usable("run")
        with self._lock:
            self._answered = False
        self.in_flight = True  # stays set if no answer comes in time: the worker may still write the slot
        r = self._held.run(self._answer_came)
        self.in_flight = False
        if isinstance(r, ShmBrokerError):
            raise r
        if r.status != P.Status.OK:
            raise from_status(r.status, r.message)
        specs = self._plan.info.outputs
        seg = self._segment
        outs = {}
        for t in r.tensors:
            view = seg.output_view(self._slot, t.offset, self._plan.out_dtypes[t.index], t.shape)
            # read-only: a write would land in the slot's output area, which the worker owns once the slot is
            # submitted again (by this block or, after it, by another request)
            view.flags.writeable = False
            outs[specs[t.index].name] = view
        self.outputs = outs
        self._handed.extend(outs.values())
        return next(iter(outs.values())) if len(specs) == 1 else dict(outs)

    def submit(self) -> Future[Outputs]:
        """Send the slot as it is without waiting. The Future holds the outputs, copied out of the slot so that
        they outlive the block, or a ShmBrokerError; ``asyncio.wrap_future`` awaits it. From here on the inputs
        are the request's (the worker reads them), so they go read-only, and the slot is freed once the request
        is answered, inside the block or after it. Once per request.

        Raises:
            ShmBrokerError: ``REQUEST_ENDED`` after the block; ``REQUEST_SENT`` once submitted.
            WorkerDied: no live worker serves the model (the slot is then free).
        """
        self._hand_over("submit")
        return self._held.submit()

    def call(self, callback: Callback) -> None:
        """Send the slot as it is; ``callback(outputs, error)`` runs when it is answered, as for ``Client.call``
        (on the client's receiving thread; it must not block), with the outputs copied out of the slot. The
        lightest way to keep zero-copy requests in flight. The inputs go read-only, and the slot is freed once
        the request is answered. Once per request.

        Raises:
            ShmBrokerError: ``REQUEST_ENDED`` after the block; ``REQUEST_SENT`` once submitted.
            WorkerDied: no live worker serves the model (the slot is then free).
        """
        self._hand_over("call")
        self._held.call(callback)

    def _hand_over(self, what: str) -> None:
        """The request is sent without waiting: its slot is its own until answered, its inputs the worker's."""
        self._check_usable(what)
        self.submitted = True
        for view in self.inputs.values():
            view.flags.writeable = False

    def _check_usable(self, what: str) -> None:
        if self._ended:
            raise ShmBrokerError(f"req.{what}(): the request's `with` block has ended and its slot serves other "
                                 f"requests now; call {what}() inside the block", "REQUEST_ENDED")
        if self.submitted:
            raise ShmBrokerError(f"req.{what}(): the request was submitted and its slot is its own until answered; "
                                 "take another with client.request(...)", "REQUEST_SENT")

    def _answer_came(self) -> None:
        """The last run()'s answer has come (receiving thread): the slot is free if the block has ended."""
        with self._lock:
            self._answered = True
            free = self._abandoned
        if free:
            self._held.free()

    def end(self) -> None:
        """The block has ended: the views go (``_views_gone``) and the slot is freed, unless a request is still
        out on it (submitted or called, or a run() that gave up waiting), in which case its answer frees it."""
        self._views_gone()
        if self.submitted:
            return
        with self._lock:
            free = not self.in_flight or self._answered
            self._abandoned = not free
        if free:
            self._held.free()

    def _views_gone(self) -> None:
        """The block has ended: later run() and inputs[...] raise REQUEST_ENDED; handed-out arrays go read-only."""
        self._ended = True
        for view in self._handed:
            view.flags.writeable = False
        self._handed.clear()
        self.inputs.clear()  # in place too: a dict the caller kept empties as well
        self.inputs = _EndedInputs()
        self.outputs.clear()
