"""gpu_worker.streams' copy plan: which ring rows a batch's copies read and write, and that a ring is page-locked
before any copy touches it."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from shmbroker.gpu_worker.codec import ModelCodec
from shmbroker.gpu_worker.engines.base import IOSpec
from shmbroker.gpu_worker.intake import ModelView
from shmbroker.gpu_worker.streams import CopyPlan


class Session(SimpleNamespace):
    """A worker session's ring as the copy plan reads it; counts the page-lock requests."""

    def __init__(self, address: int, output_bases: list[int]) -> None:
        super().__init__(segment=SimpleNamespace(address=address), layout=SimpleNamespace(output_bases=output_bases),
                         registered=0)

    def ensure_registered(self) -> bool:
        self.registered += 1
        return True


def test_output_copies_page_lock_a_ring_no_input_copy_touched() -> None:
    """A photo model's rows reach the device through its stage, not ``inputs``: its answers' copies into the
    ring must still come from page-locked memory, or the runner would wait for each batch to compute."""
    view = ModelView(1, "m", 8, [IOSpec("x", np.dtype(np.uint8), (-1,))],
                     [IOSpec("scores", np.dtype(np.float32), (-1, 2))], 500)
    plan = CopyPlan(ModelCodec(view), batched=False)
    a, b = Session(1 << 20, [4096, 8192]), Session(2 << 20, [4096, 8192])
    works = [SimpleNamespace(session=a, req=SimpleNamespace(slot=1), rows=2),
             SimpleNamespace(session=b, req=SimpleNamespace(slot=0), rows=1)]
    dsts, srcs, sizes = plan.outputs(works, [0x7000_0000])  # type: ignore[arg-type]
    assert a.registered >= 1 and b.registered >= 1
    assert dsts == [(1 << 20) + 8192, (2 << 20) + 4096]
    assert srcs == [0x7000_0000, 0x7000_0000 + 2 * 8]
    assert sizes == [2 * 8, 8]
