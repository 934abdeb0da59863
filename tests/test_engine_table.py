"""broker.common.engines: the engine table is the one list of engines; a plugin package adds one with one module
and one entry point, and a real broker serves requests from it in both worker modes."""

from __future__ import annotations

import os
import re
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from shmbroker.broker.common import config as C
from shmbroker.broker.common.engines import BUILTIN, ENTRY_POINT_GROUP, built_engines, engine_table, gpu_engines
from tests.conftest import RunningBroker, start_broker

PLUGIN = '''
"""A plugin engine for the table's test: the tiny model's IO, every output twice its input."""
import numpy as np

from shmbroker.broker.common.engines import EngineEntry
from shmbroker.gpu_worker.engines.meta import onnx_file_specs
from shmbroker.gpu_worker.model_source import resolve

ENTRY = EngineEntry("doubler", "doubler_engine:Doubler", gpu=False, built=False, summary="twice the input")


class Doubler:
    @classmethod
    def from_config(cls, source, *, device, model):
        return cls(source, model.null_compute_us)

    def __init__(self, source, unused):
        self.inputs, self.outputs = onnx_file_specs(source)

    def run(self, feeds):
        return [2 * feeds[self.inputs[0].name]]

    def close(self):
        pass
'''


def test_the_configs_engine_choices_are_the_tables_names() -> None:
    for name in engine_table():
        section = {"models": {"m": {"path": "m.onnx", "engine": name}}, "worker": {"devices": [0]}}
        assert C.parse(section).models["m"].engine == name
    with pytest.raises(C.ConfigError) as err:
        C.parse({"models": {"m": {"path": "m.onnx", "engine": "tvm"}}})
    listed = re.findall(r"'([a-z0-9_]+)'", str(err.value).split("expected one of", 1)[1])
    assert listed == list(engine_table())


def test_build_and_the_gpu_set_come_from_the_table() -> None:
    import argparse

    from shmbroker.broker.modelbuild.args import add_build_arguments

    ap = argparse.ArgumentParser()
    add_build_arguments(ap)
    (engine_action,) = [a for a in ap._actions if a.dest == "engine"]
    assert tuple(engine_action.choices or ()) == built_engines() == ("inductor", "tensorrt")
    assert set(gpu_engines()) == {e.name for e in BUILTIN if e.gpu}
    assert "onnxruntime" not in gpu_engines()


def _plugin(where: Path) -> Path:
    """An installed plugin package as pip leaves one: a module and a dist-info with the entry point."""
    where.mkdir()
    (where / "doubler_engine.py").write_text(textwrap.dedent(PLUGIN))
    info = where / "doubler_engine-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: doubler-engine\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\ndoubler = doubler_engine:ENTRY\n")
    return where


@pytest.fixture(scope="module", params=["process", "thread"])
def plugin_broker(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningBroker]:
    tmp = tmp_path_factory.mktemp(f"plugin-{request.param}")
    plugin = _plugin(tmp / "site")
    models = '[models.dbl]\npath = "builtin:tiny"\nengine = "doubler"\nmax_batch = 8\ntimeout_ms = 10000\n'
    path = os.pathsep.join(p for p in (str(plugin), os.environ.get("PYTHONPATH", "")) if p)
    b = start_broker(tmp, request.param, models=models, env={"PYTHONPATH": path})
    try:
        yield b
    finally:
        b.stop()


def test_a_plugin_engine_from_an_entry_point_serves_requests(plugin_broker: RunningBroker) -> None:
    from shmbroker.client import Client

    x = np.arange(3 * 256, dtype=np.float32).reshape(3, 256)
    with Client(str(plugin_broker.runtime_dir)) as c:
        out = c.infer("dbl", x)
        futures = [c.submit("dbl", x[i : i + 1] + i) for i in range(3)]
        assert isinstance(out, np.ndarray)
        np.testing.assert_array_equal(out, 2 * x)
        for i, fut in enumerate(futures):
            np.testing.assert_array_equal(fut.result(30), 2 * (x[i : i + 1] + i))
