"""gpu_worker.batching and broker.common.batchrules: the policy comes from a model's config section, the config's
rule choices are the table's names, and a third rule, one class and one entry point, changes what batches form
in a real Batcher."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from shmbroker.broker.common import config as C
from shmbroker.broker.common.batchrules import BUILTIN, ENTRY_POINT_GROUP, RuleEntry, rule_table
from shmbroker.gpu_worker.batcher import Batcher, Queued
from shmbroker.gpu_worker.batching import BatchingRule, BatchPolicy, IdleDispatch, TritonRule

LONG_US = 10_000_000  # a delay (the most the config allows) that no test waits for


class HalfBatches(BatchingRule):
    """A third rule: a batch is due at half of ``max_batch`` rows or by the delay, never for an idle executor,
    and takes at most half of ``max_batch``."""

    def __init__(self, policy: BatchPolicy) -> None:
        super().__init__(policy)
        self.half = max(1, policy.max_batch // 2)

    def at_once(self, rows: int, running: int) -> bool:
        return rows >= self.half

    def size(self, rows: int) -> int:
        return self.half


HALF = RuleEntry("half", f"{__name__}:HalfBatches", "half of max_batch at once, else by the delay")


@pytest.fixture
def half_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """``HALF`` installed as a plugin package leaves it: a dist-info whose entry point names it."""
    info = tmp_path / "half_rule-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: half-rule\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\nhalf = {__name__}:HALF\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    rule_table.cache_clear()
    yield
    rule_table.cache_clear()


def _model(**keys: object) -> C.ModelSection:
    section = {"path": "m.onnx", "max_batch": 8, "max_queue_delay_us": LONG_US, **keys}
    return C.parse({"models": {"m": section}}).models["m"]


def _batcher(batching: str, delay_us: int = LONG_US) -> Batcher[Queued[str]]:
    return Batcher(BatchPolicy.from_config(_model(batching=batching, max_queue_delay_us=delay_us), device=False))


def _put(b: Batcher[Queued[str]], names: str) -> None:
    for name in names:
        assert b.put(Queued(name, 1, time.monotonic() + 60.0), wake=False)


def _batches(b: Batcher[Queued[str]]) -> list[str]:
    """Every batch due now, each as its names joined."""
    out = []
    while (take := b.take_now()) is not None:
        out.append("".join(e.item for e in take.batch))
    return out


def test_the_configs_rule_choices_are_the_tables_names() -> None:
    assert [e.name for e in BUILTIN] == ["idle", "triton"]
    for name in rule_table():
        assert _model(batching=name).batching == name
    assert _model().batching == "idle"
    with pytest.raises(C.ConfigError) as err:
        _model(batching="half")
    assert "key 'models.m.batching': unknown batching rule 'half'" in str(err.value)
    listed = re.findall(r"'([a-z0-9_]+)'", str(err.value).split("expected one of", 1)[1])
    assert listed == list(rule_table())


def test_the_policy_is_the_models_config_section() -> None:
    mc = _model(batching="triton", preferred_batch_sizes=[2, 4], max_queue_size=9, instances=3,
                serial_compute=False, fill_while_busy=True, trim_to_sizes=False, early_copies=True,
                batch_by_session=True)
    host, device = BatchPolicy.from_config(mc, device=False), BatchPolicy.from_config(mc, device=True)
    assert host == BatchPolicy(8, LONG_US, (2, 4), 9, "triton", 3, False, True, False, True, True)
    assert not BatchPolicy.from_config(_model(), device=True).by_session
    assert device.executors == 1  # stream slots share one device
    assert host.early
    assert type(Batcher(host).rule) is TritonRule
    assert type(Batcher(BatchPolicy.from_config(_model(), device=True)).rule) is IdleDispatch


def test_idle_dispatch_and_tritons_rule_form_different_batches() -> None:
    idle, triton = _batcher("idle"), _batcher("triton")
    for b in (idle, triton):
        _put(b, "abcdef")
    assert _batches(idle) == ["abcdef"]  # the executor is idle: all six at once
    assert _batches(triton) == []  # six of eight rows, the delay a minute away


def test_a_third_rule_plugs_in_through_the_table_and_forms_its_batches(half_plugin: None) -> None:
    assert rule_table()["half"] == HALF
    b = _batcher("half")
    assert type(b.rule) is HalfBatches
    _put(b, "a")
    assert _batches(b) == []  # nothing runs, yet no idle dispatch: the rule waits for four rows or the delay
    _put(b, "bcdefghij")
    assert _batches(b) == ["abcd", "efgh"]  # at most half of max_batch 8; "ij" wait for the delay
    assert len(b) == 2
    prompt = _batcher("half", delay_us=0)
    _put(prompt, "abcdef")
    assert _batches(prompt) == ["abcd", "ef"]  # by the delay, still capped at half
