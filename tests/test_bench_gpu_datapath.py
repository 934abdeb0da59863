"""bench.gpu_datapath on a device in host memory (tests/hostdevice.py): every batch's rows go from the ring to
the device and back, and the figures are the device's timeline's."""

from __future__ import annotations

import secrets

import numpy as np
import pytest

from shmbroker.bench import gpu_datapath, gpu_report
from shmbroker.broker.common.ring import RingLayout, Segment, segment_name
from shmbroker.gpu_worker import cuda
from shmbroker.gpu_worker.streams import StreamSlot
from tests.hostdevice import DoublingEngine, HostDevice

ROWS = 8
ROW_BYTES = 16  # DoublingEngine: 4 float32 in and out


def test_each_batch_copies_every_row_in_and_its_result_back(host_device: HostDevice) -> None:
    engine = DoublingEngine(host_device)
    seg = Segment.create(segment_name("t" + secrets.token_hex(4), 0), RingLayout(1, ROWS, ROW_BYTES, ROW_BYTES))
    slots = [StreamSlot(i, engine, ROWS) for i in range(2)]
    try:
        xs = np.arange(ROWS * 4, dtype=np.float32).reshape(ROWS, 1, 4) + 1
        for r in range(ROWS):
            seg.input_view(r, 0, np.dtype("float32"), (1, 4))[...] = xs[r]
        f = gpu_datapath.run_batches(engine, slots, seg, ROWS, 0.0)
        for r in range(ROWS):
            np.testing.assert_array_equal(seg.output_view(r, 0, np.dtype("float32"), (1, 4)), 2 * xs[r],
                                          err_msg=f"row {r}: not its own result")
    finally:
        for s in slots:
            s.close()
        seg.close()
    assert f["batches"] == gpu_datapath.MIN_BATCHES * 2
    assert engine.batches == [ROWS] * (f["batches"] + 2)  # and one warm-up batch per slot
    # the device computes one batch at a time, so a batch's compute is at least its rows' device time
    assert f["compute_ms"] >= ROWS * host_device.row_s * 1e3 * 0.999
    assert f["items_per_s"] <= 1 / host_device.row_s * 1.001
    assert f["h2d_ms"] >= ROWS * host_device.copy_s * 1e3 * 0.999  # and any wait for the host to issue them


def test_with_copies_unregisters_its_ring_and_reports_in_the_table(host_device: HostDevice,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    registered: set[int] = set()
    monkeypatch.setattr(cuda, "host_register", lambda addr, n: registered.add(addr))
    monkeypatch.setattr(cuda, "host_unregister", registered.remove)
    f = gpu_datapath.with_copies(DoublingEngine(host_device), 3, ROWS, 0.0)
    assert not registered, "the ring stayed registered"
    assert f["streams"] == 3 and f["batch"] == ROWS and f["batches"] == gpu_datapath.MIN_BATCHES * 3
    limit = {"items_per_s": 1000.0, "best_batch": ROWS, "max_batch_ms": 16.0, "load_s": 0.1,
             "by_batch": {str(ROWS): {"items_per_s": 1000.0}}, "with_copies": f}
    lines = gpu_report._limit_lines("double", limit)
    assert any(line.startswith("(a'') double: 3 slots, copies") and f"{f['items_per_s']:,.1f}" in line
               for line in lines), lines
    t = gpu_report.targets({"limit": limit, "broker": {"per_s": f["items_per_s"] / 2}})
    assert t["c_over_a_copies_info"]["value"] == 0.5
