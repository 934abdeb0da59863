"""Precomputed wire bytes of one model's descriptors, for the hot path of intake and completion.

A well-behaved client packs a request's tensors as ``ring.pack_offsets`` says; for a given row count its
descriptors are then always the same bytes. Intake compares the received bytes with these (one compare
accepts dtype, shape, size and span at once, since the canonical layout is valid for every slot that
holds ``rows``); anything else takes the detailed checks in ``intake``, which name the faulty field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from shmbroker.broker.common import protocol as P
from shmbroker.broker.common.ring import pack_offsets
from shmbroker.gpu_worker.engines.base import IOSpec
from shmbroker.gpu_worker.intake import ModelView

if TYPE_CHECKING:
    from shmbroker.gpu_worker.work import Work

DONE_ENVELOPE = P.envelope(P.MsgKind.DONE)
OK = int(P.Status.OK)


@dataclass(frozen=True, slots=True)
class RowsCanon:
    """A request of ``rows`` rows packed canonically (the worker's twin of the client's ``RowsLayout``)."""

    in_desc_bytes: bytes  # its SUBMIT tensor descriptors, as a well-behaved client packs them
    in_descs: list[P.TensorDesc]  # the same, decoded: shared by every such request (compared by identity)
    out_offsets: list[int]  # where its outputs go in its slot's output region
    out_desc_bytes: bytes  # its DONE tensor descriptors


class ModelCodec:
    def __init__(self, model: ModelView) -> None:
        self.model = model
        self.n_inputs = len(model.inputs)
        self.n_outputs = len(model.outputs)
        self._in_codes = [P.dtype_code(s.dtype) for s in model.inputs]
        self._out_codes = [P.dtype_code(s.dtype) for s in model.outputs]
        self.rows: dict[int, RowsCanon] = {}
        for rows in range(1, model.max_batch + 1):
            in_bytes, in_descs = self._canon(model.inputs, self._in_codes, rows)
            out_bytes, out_descs = self._canon(model.outputs, self._out_codes, rows)
            self.rows[rows] = RowsCanon(in_bytes, in_descs, [d.offset for d in out_descs], out_bytes)

    @staticmethod
    def _canon(specs: list[IOSpec], codes: list[P.DType], rows: int) -> tuple[bytes, list[P.TensorDesc]]:
        offsets, _end = pack_offsets([rows * s.item_bytes for s in specs])
        descs = [
            P.TensorDesc(k, int(codes[k]), offsets[k], rows * s.item_bytes, (rows, *s.item_shape))
            for k, s in enumerate(specs)
        ]
        return b"".join(P.pack_tensor(d) for d in descs), descs

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
