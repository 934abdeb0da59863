"""bench.peers.run end to end on the CPU: real servers, real client processes, the tiny model.

shmbroker's two routes run everywhere. The peers' servers run only where their packages are installed (they
are no dependency of shmbroker: ``pip install nvidia-pytriton litserve fastapi uvicorn httptools
'tritonclient[grpc]'``); without them those tests are skipped, and a skip proves nothing about them.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shmbroker.bench.peers import engine as E
from shmbroker.bench.peers import run

QUICK = ["--model", "tiny", "--processes", "2", "--in-flight", "2", "--duration", "0.5", "--c1-duration", "0.5",
         "--warmup", "0.3", "--limit-seconds", "0.3", "--rows", "4", "--http-workers", "1"]


def _run(tmp_path: Path, peers: str) -> tuple[int, dict[str, Any]]:
    out = tmp_path / "peers.json"
    code = run.main([*QUICK, "--peers", peers, "--out", str(out)])
    return code, json.loads(out.read_text())


def _answered(route: dict[str, Any]) -> None:
    for m in (route["c1"], *route["saturation"]):
        assert m["per_s"] > 0
        assert m["answers"]["checked"] >= m["completed"] > 0
        assert m["answers"]["wrong"] == 0
        assert m["cpu_us_per_request"]["host"] is not None


@pytest.mark.timeout(240)
def test_shmbroker_through_its_ring_client_and_its_http_front_end(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    code, doc = _run(tmp_path, "shmbroker")
    assert code == 0, doc["failures"]
    routes = doc["servers"]["shmbroker"]["routes"]
    assert set(routes) == {"ring", "http"}
    for r in routes.values():
        _answered(r)
    assert doc["servers"]["shmbroker"]["broker"]["shm_clean"]
    assert doc["inprocess"]["runner_limit"]["items_per_s"] > 0
    assert "| shmbroker | Client.call (rings) |" in capsys.readouterr().out


@pytest.mark.timeout(240)
def test_answers_that_differ_from_the_engines_are_counted_wrong_and_fail_the_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = E.reference
    monkeypatch.setattr(E, "reference", lambda r, rows: real(r, rows) + np.float32(0.5))
    code, doc = _run(tmp_path, "shmbroker")
    assert code == 1
    ring = doc["servers"]["shmbroker"]["routes"]["ring"]
    assert ring["c1"]["answers"]["wrong"] == ring["c1"]["answers"]["checked"] > 0
    assert ring["c1"]["completed"] == 0
    assert "max abs difference 0.5" in ring["c1"]["answers"]["first_wrong"]
    assert any("wrong answers" in f for f in doc["failures"])


PEERS = {"fastapi": ("fastapi", "uvicorn", "httptools"), "litserve": ("litserve",),
         "pytriton": ("pytriton", "tritonclient")}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("peer", sorted(PEERS))
def test_a_peer_server_answers_every_request_right(tmp_path: Path, peer: str) -> None:
    missing = [m for m in PEERS[peer] if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"{peer} needs {missing}, not installed here: not tested")
    if peer == "pytriton" and int(np.__version__.split(".")[0]) >= 2 and not os.environ.get("PEERS_PYTRITON_NUMPY"):
        pytest.skip("PyTriton 0.7 needs numpy 1: give a folder holding one in PEERS_PYTRITON_NUMPY; not tested")
    code, doc = _run(tmp_path, peer)
    assert code == 0, doc["failures"]
    server = doc["servers"][peer]
    assert server["routes"]
    for r in server["routes"].values():
        _answered(r)
    assert server["exit_code"] is not None
    assert not server["killed"]


def test_a_missing_peer_package_is_a_named_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(run.NEEDS, "fastapi", (("surely_not_a_module_xyz",), "surely-not"))
    code, doc = _run(tmp_path, "fastapi")
    assert code == 1
    assert doc["servers"]["fastapi"]["error"] == "not installed: surely_not_a_module_xyz (pip install surely-not)"
