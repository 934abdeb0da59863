"""examples/node/infer.mjs, a Node caller with only its standard library, against `shmbroker http --unix` on a
live broker: its output is the model's answer, and a refused request exits 1 with the front-end's reason.
Needs `node` (.ci/run installs Debian's nodejs)."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
from collections.abc import Iterator

import numpy as np
import pytest

from tests.conftest import REPO, running_broker
from tests.frontends import Front, start_frontend
from tests.models import direct

NODE = shutil.which("node")
SCRIPT = REPO / "examples" / "node" / "infer.mjs"
pytestmark = pytest.mark.skipif(NODE is None, reason="no node (apt-get install nodejs; .ci/run installs it)")


@pytest.fixture(scope="module")
def front(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Front]:
    tmp = tmp_path_factory.mktemp("node")
    with running_broker(tmp) as b:
        f = start_frontend(b, tmp / "http.log", workers=1, unix=tmp / "http.sock")
        try:
            yield f
        finally:
            f.proc.send_signal(signal.SIGTERM)
            assert f.proc.wait(60) == 0, f.log_path.read_text()[-4000:]


def _node(front: Front, *args: str) -> subprocess.CompletedProcess[str]:
    assert NODE is not None
    return subprocess.run([NODE, str(SCRIPT), front.unix, *args], capture_output=True, text=True, timeout=60,
                          check=False)


def test_node_gets_the_models_answer_over_the_unix_socket(front: Front) -> None:
    r = _node(front, "tiny", "0.5")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["model_name"] == "tiny" and doc["outputs"][0]["shape"] == [1, 256]
    y = np.array(doc["outputs"][0]["data"], np.float32).reshape(1, 256)
    np.testing.assert_allclose(y, direct("tiny", np.full((1, 256), 0.5, np.float32)), rtol=0, atol=1e-5)


def test_node_reports_what_the_front_end_refuses(front: Front) -> None:
    r = _node(front, "no-such-model")
    assert r.returncode == 1 and "404" in r.stderr and "no-such-model" in r.stderr, r.stderr
    r = _node(front, "tiny", "not-a-number")
    assert r.returncode == 2 and "usage" in r.stderr, r.stderr
