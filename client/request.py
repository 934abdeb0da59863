"""Zero-copy requests: a held slot whose input views the caller fills and whose outputs it reads in place."""

from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING

import numpy as np

from broker import protocol as P
from client.errors import ShmBrokerError, from_status
from client.session import GRACE_S, ModelPlan

if TYPE_CHECKING:
    from client.client import Client, Outputs


class Request:
    """A held slot for zero-copy use: write ``inputs`` in place, ``run()``, then read the outputs in place."""

    def __init__(self, client: Client, plan: ModelPlan, slot: int, rows: int, timeout: float | None) -> None:
        self._client = client
        self._plan = plan
        self._slot = slot
        self._rows = rows
        self._timeout = timeout
        self.in_flight = False
        offsets = plan.input_offsets(rows)
        self.inputs: dict[str, np.ndarray] = {
            s.name: client.segment.input_view(slot, offsets[k], plan.in_dtypes[k], (rows, *plan.in_item_shapes[k]))
            for k, s in enumerate(plan.info.inputs)
        }
        self.outputs: dict[str, np.ndarray] = {}

    def run(self) -> Outputs:
        """Send the slot as it is and wait; the result views point into the slot (no copy)."""
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
        self.outputs = {
            specs[t.index].name: seg.output_view(self._slot, t.offset, self._plan.out_dtypes[t.index], t.shape)
            for t in r.tensors
        }
        return next(iter(self.outputs.values())) if len(specs) == 1 else dict(self.outputs)

    def views_gone(self) -> None:
        self.inputs.clear()
        self.outputs.clear()
