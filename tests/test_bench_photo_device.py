"""bench/photo_device.py's loop, the GPU photo bench's (a), without a GPU: stand-ins for the stage, the stream
slots and their events (a unit with no process boundary); tests/gpu runs it on a device."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from shmbroker.bench.common import BenchError
from shmbroker.bench.photo_device import DeviceShape
from shmbroker.bench.photo_tally import tally_figures
from shmbroker.gpu_worker import cuda


@dataclass
class _Event:
    name: str
    log: list[str]

    def record(self, stream: Any) -> None:
        self.log.append(f"record {self.name}")

    def synchronize(self) -> None:
        self.log.append(f"wait {self.name}")


class _Ctx:
    def __init__(self, index: int, log: list[str]) -> None:
        self.index, self.log = index, log

    def enqueue(self, rows: int) -> None:
        self.log.append(f"engine {self.index} x{rows}")


class _Slot:
    def __init__(self, index: int, log: list[str]) -> None:
        self.index = index
        self.stream = object()
        self.start, self.copied_in, self.computed = (_Event(f"{n}{index}", log) for n in ("start", "in", "done"))
        self.ctx = _Ctx(index, log)


@dataclass
class _Stage:
    log: list[str]
    bad: dict[int, str] = field(default_factory=dict)
    backend: str = "stand-in"

    def run_rows(self, rows: list[memoryview], slot: _Slot) -> tuple[int, dict[int, str]]:
        self.log.append(f"stage {slot.index} x{len(rows)}")
        return len(rows) - len(self.bad), self.bad


@dataclass
class _Runner:
    slots: list[_Slot]
    stage: _Stage


def _shape(log: list[str], slots: int = 2, bad: dict[int, str] | None = None) -> DeviceShape:
    return DeviceShape(_Runner([_Slot(i, log) for i in range(slots)], _Stage(log, bad or {})))  # type: ignore[arg-type]


@pytest.fixture(autouse=True)
def _device_times(monkeypatch: pytest.MonkeyPatch) -> None:
    """2 ms in the stage and 5 ms in the engine, every batch."""
    monkeypatch.setattr(cuda, "elapsed_ms", lambda a, b: 2.0 if a.name.startswith("start") else 5.0)


def test_the_slots_take_batches_in_turn_each_waited_for_before_its_next() -> None:
    log: list[str] = []
    images = [memoryview(bytes([i])) for i in range(10)]
    tally = _shape(log).window(images, 4, 0.0, 5)
    assert tally.runs == 5
    assert tally.decode_s == pytest.approx(5 * 0.002) and tally.engine_s == pytest.approx(5 * 0.005)
    stages = [line for line in log if line.startswith("stage")]
    assert stages == ["stage 0 x4", "stage 1 x4", "stage 0 x4", "stage 1 x4", "stage 0 x4"]
    pending = {"0": False, "1": False}  # a slot's batch launched and not yet waited for
    for line in log:
        word, slot = line.split()[:2]
        if word == "stage":
            assert not pending[slot], log  # its previous batch was collected first
        elif word == "engine":
            pending[slot] = True
        elif word == "wait":
            pending[slot[-1]] = False
    assert not any(pending.values()), log  # every batch collected by the end
    f = tally_figures(tally, 4, 1)
    assert f["bound_by"] == "engine" and f["decode_ms_per_image"] == pytest.approx(0.5)


def test_a_photo_that_does_not_decode_stops_the_measurement_naming_it() -> None:
    log: list[str] = []
    with pytest.raises(BenchError, match="a photo of the set does not decode: row 0: corrupt JPEG"):
        _shape(log, bad={0: "row 0: corrupt JPEG"}).window([memoryview(b"x")] * 4, 2, 0.0, 1)
