"""Sessions' rows: by default a request may have as many rows as the largest max_batch; errors name the setting."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import numpy as np
import pytest

from shmbroker.broker.common import protocol as P
from shmbroker.broker.serving.sessions import session_rows
from shmbroker.client import BadInput, Client
from tests.conftest import RunningBroker, arr, start_broker
from tests.models import direct


def _models(*max_batches: int) -> list[P.ModelInfo]:
    return [P.ModelInfo(i, f"m{i}", b, [], [], 1000) for i, b in enumerate(max_batches)]


def test_rows_default_to_the_largest_max_batch_and_never_pass_it() -> None:
    models = _models(4, 16)
    assert session_rows(0, 0, models) == 16  # neither the client nor the config says: the largest max_batch
    assert session_rows(0, 2, models) == 2  # [sessions] default_max_items
    assert session_rows(3, 2, models) == 3  # the client's own
    assert session_rows(100, 0, models) == 16


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
