"""Zero-copy requests: a held slot whose input views the caller fills and whose outputs it reads in place."""

from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING

import numpy as np

from shmbroker.broker.common import protocol as P
from shmbroker.client.errors import ShmBrokerError, from_status
from shmbroker.client.session import GRACE_S, ModelPlan

if TYPE_CHECKING:
    from shmbroker.client.client import Client, Outputs


class _EndedInputs(dict[str, np.ndarray]):
    """``req.inputs`` once the block has ended: empty, and a lookup says why instead of a bare KeyError."""

    def __missing__(self, name: str) -> np.ndarray:
        raise ShmBrokerError(f"req.inputs[{name!r}]: the request's `with` block has ended and its slot serves "
                             "other requests now; fill the inputs inside the block", "REQUEST_ENDED")


class Request:
    """A held slot for zero-copy use: write ``inputs`` in place, ``run()``, then read the outputs in place.

    Every view is valid inside the ``with c.request(...)`` block only. NumPy cannot revoke a view, so arrays kept
    past the block still read the slot, which the next request to take it overwrites: copy what you keep. At the
    end of the block the arrays handed out (``inputs[name]`` and ``run()``'s outputs) are made read-only, so a
    kept one cannot write into another request's slot (views the caller sliced from them are not reached).
    """

    def __init__(self, client: Client, plan: ModelPlan, slot: int, rows: int, timeout: float | None) -> None:
        self._client = client
        self._plan = plan
        self._slot = slot
        self._rows = rows
        self._timeout = timeout
        self._ended = False
        self.in_flight = False
        offsets = plan.input_offsets(rows)
        self.inputs: dict[str, np.ndarray] = {
            s.name: client.segment.input_view(slot, offsets[k], plan.in_dtypes[k], (rows, *plan.in_item_shapes[k]))
            for k, s in enumerate(plan.info.inputs)
        }
        self._handed: list[np.ndarray] = list(self.inputs.values())  # frozen at the end of the block
        self.outputs: dict[str, np.ndarray] = {}

    def run(self) -> Outputs:
        """Send the slot as it is and wait; the outputs are read-only views into the slot (no copy), valid inside
        the ``with`` block only: they change when a later request reuses the slot."""
        if self._ended:
            raise ShmBrokerError("req.run(): the request's `with` block has ended and its slot serves other "
                                 "requests now; call run() inside the block", "REQUEST_ENDED")
        self._client._check_may_wait()
        done: Future[P.Result | ShmBrokerError] = Future()
        self.in_flight = True
        views = self._client._views_for(self._plan, self._slot, self._rows)
        self._client._send(self._slot, self._plan, views, self._timeout, done.set_result, release=False,
                           hint_wait=True)
        wait = (self._timeout if self._timeout is not None else self._plan.info.timeout_ms / 1e3) + GRACE_S
        try:
            r = self._client.wait_for(done, wait, self._slot)
        finally:
            self._client._hint_wait.done()
        self.in_flight = False
        if isinstance(r, ShmBrokerError):
            raise r
        if r.status != P.Status.OK:
            raise from_status(r.status, r.message)
        specs = self._plan.info.outputs
        seg = self._client.segment
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

    def views_gone(self) -> None:
        """The block has ended: later run() and inputs[...] raise REQUEST_ENDED; handed-out arrays go read-only."""
        self._ended = True
        for view in self._handed:
            view.flags.writeable = False
        self._handed.clear()
        self.inputs.clear()  # in place too: a dict the caller kept empties as well
        self.inputs = _EndedInputs()
        self.outputs.clear()
