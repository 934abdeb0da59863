"""bench.apis: one short round of the client APIs (and the zero-copy forms) against a real broker writes each
API's rate and the two targets into its JSON document."""

from __future__ import annotations

import json
from pathlib import Path

from shmbroker.bench import apis


def test_one_round_measures_every_api_and_the_targets(tmp_path: Path) -> None:
    out = tmp_path / "apis.json"
    argv = ["--rounds", "1", "--duration", "0.5", "--processes", "2", "--in-flight", "8", "--out", str(out)]
    assert apis.main(argv) == 0
    doc = json.loads(out.read_text())
    (r,) = doc["rounds"]
    for api in apis.APIS:
        assert r[f"{api}_per_s"] > 0, api
    assert r["submit_over_call"] == round(r["submit_per_s"] / r["call_per_s"], 3)
    assert r["async_zero_over_async"] == round(r["async_zero_per_s"] / r["async_per_s"], 3)
    assert r["infer_over_call"] == round(r["infer_per_s"] / r["call_per_s"], 3)
    assert doc["targets"]["async_over_call"]["value"] == r["async_over_call"]
    assert doc["targets"]["submit_over_call"]["target"] == apis.TARGET
