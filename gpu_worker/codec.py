"""A model's canonical layouts (protocol.CanonicalRows) for every row count, and the DONE of OK answers.

A well-behaved client packs a request's tensors as ``protocol.CanonicalRows`` says; for a given row count its
descriptors are then always the same bytes. Intake compares the received bytes with these (one compare
accepts dtype, shape, size and span at once, since the canonical layout is valid for every slot that
holds ``rows``); anything else takes the detailed checks in ``intake``, which name the faulty field.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shmbroker.broker.common import protocol as P
from shmbroker.broker.common.protocol import DONE_ENVELOPE
from shmbroker.gpu_worker.intake import ModelView

if TYPE_CHECKING:
    from shmbroker.gpu_worker.work import Work

OK = int(P.Status.OK)


class ModelCodec:
    def __init__(self, model: ModelView) -> None:
        self.model = model
        self.n_inputs = len(model.inputs)
        self.n_outputs = len(model.outputs)
        ins = [(s.dtype, s.item_shape) for s in model.inputs]
        outs = [(s.dtype, s.item_shape) for s in model.outputs]
        # every row count the model takes, built once: intake and completion only look these up
        self.rows: dict[int, P.CanonicalRows] = {
            rows: P.CanonicalRows.of(ins, outs, rows) for rows in range(1, model.max_batch + 1)}
        # what intake accepts by one compare: none for images, whose descriptors differ per request
        image = model.photos is not None and model.photos.kind == P.InputKind.IMAGE
        self.intake: dict[int, P.CanonicalRows] = {} if image else self.rows

    def done_ok(self, session_id: int, done: list[Work]) -> list[bytes]:
        """The frames of a DONE that reports these requests as OK, their outputs at the canonical offsets."""
        records = []
        tensors = []
        n_t = 0
        n_out = self.n_outputs
        canon = self.rows
        pack, ok = P.RESULT.pack, OK  # locals: read once per DONE, not per request
        for w in done:
            req = w.req
            records.append(pack(req.request_id, req.slot, req.generation, ok, n_t, n_out, 0, 0, 0))
            tensors.append(canon[w.rows].out_desc_bytes)
            n_t += n_out
        return [DONE_ENVELOPE, P.done_body(session_id, records, tensors, n_t)]
