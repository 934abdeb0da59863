"""bench.peers, its pure parts: answer checking, the measurement's figures, the table and its verdict, the load's
request bodies, the FastAPI peer's batcher (asyncio only, no FastAPI), the packing rules and the options."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import numpy as np
import pytest

from shmbroker.bench.peers import answers, load, pack, run, stats, table
from shmbroker.bench.peers.fastapi_peer import Batcher

# ---- answers ----------------------------------------------------------------------------------------------------


def _checker(tol: float = 1e-3) -> answers.Checker:
    return answers.Checker(np.array([[0.25, 0.75], [0.5, 0.5]], dtype=np.float32), tol)


def test_an_answer_within_the_tolerance_passes_and_its_difference_is_kept() -> None:
    c = _checker()
    assert c.check(0, np.array([[0.2505, 0.7495]], dtype=np.float32))  # with its batch dimension of 1
    assert c.check(3, np.array([0.5, 0.5], dtype=np.float32))  # row 3 is reference row 1
    assert c.tally.checked == 2
    assert c.tally.wrong == 0
    assert c.tally.max_abs_diff == pytest.approx(5e-4, rel=1e-3)


def test_wrong_answers_are_counted_and_the_first_is_described() -> None:
    c = _checker()
    assert not c.check(1, np.array([0.5, 0.51], dtype=np.float32))
    assert not c.check(0, np.array([0.25, 0.75, 0.0], dtype=np.float32))
    assert not c.check(0, np.array([np.nan, 0.75], dtype=np.float32))
    assert not c.check_bytes(0, b"\x00" * 4, "float32")
    assert not c.unreadable(1, "no binary output")
    assert c.tally.checked == 5
    assert c.tally.wrong == 5
    assert c.tally.first_wrong.startswith("row 1: max abs difference 0.01 > tolerance 0.001")


def test_an_answer_in_raw_bytes_is_read_as_one_output_row() -> None:
    c = _checker()
    assert c.check_bytes(1, np.array([0.5, 0.5], dtype=np.float32).tobytes(), "float32")
    assert not c.check_bytes(1, np.array([0.5, 0.4], dtype=np.float32).tobytes(), "float32")


def test_a_bad_tolerance_and_unpaired_rows_are_refused_by_name() -> None:
    with pytest.raises(answers.AnswerError, match="--tolerance"):
        _checker(-1.0)
    with pytest.raises(answers.AnswerError, match="2 input rows and 3 reference rows"):
        answers.pair(np.zeros((2, 4)), np.zeros((3, 2)))


def test_tallies_add_up_and_round_trip_through_a_dict() -> None:
    a = answers.Tally(10, 1, 0.5, "row 3: x")
    a.add(answers.Tally.from_dict(answers.Tally(5, 2, 0.7, "row 9: y").as_dict()))
    assert (a.checked, a.wrong, a.max_abs_diff, a.first_wrong) == (15, 3, 0.7, "row 3: x")


# ---- stats ------------------------------------------------------------------------------------------------------


def test_cumulative_readings_are_interpolated_and_none_outside_them() -> None:
    readings = [(10.0, 1.0), (11.0, 3.0), (12.0, 4.0)]
    assert stats.at(readings, 10.5) == pytest.approx(2.0)
    assert stats.at(readings, 11.0) == 3.0
    assert stats.at(readings, 9.0) is None
    assert stats.delta(readings, 10.5, 11.5) == pytest.approx(1.5)
    assert stats.delta(readings, 10.5, 13.0) is None
    assert stats.mean_inside([(1.0, 90.0), (2.0, 100.0), (3.0, 0.0)], 0.5, 2.5) == 95.0
    assert stats.mean_inside([(1.0, 90.0)], 2.0, 3.0) is None


def _part(completed: int, start: float, latency_ms: float, wrong: int = 0) -> dict[str, object]:
    return {"completed": completed, "errors": wrong, "error_codes": {"wrong answer": wrong} if wrong else {},
            "latency_ns": np.full(completed, int(latency_ms * 1e6), dtype=np.int64), "window_s": 2.0,
            "window_monotonic": [start, start + 2.0], "cpu_s": 0.5, "in_flight": 4,
            "answers": answers.Tally(completed + wrong, wrong, 1e-5, "").as_dict()}


def test_a_measurement_merges_its_processes_and_divides_cpu_by_answers() -> None:
    parts = [_part(1000, 100.0, 2.0), _part(3000, 100.1, 4.0, wrong=2)]
    cpu = [(99.0, 0.0), (101.0, 1.0), (103.0, 2.0)]  # the server: 0.5 CPU seconds a second
    gpu = [(100.5, 80.0), (101.5, 100.0), (104.0, 0.0)]
    f = stats.merge(parts, 8, cpu, gpu)
    assert f["per_s"] == 2000.0
    assert f["completed"] == 4000
    assert f["errors"] == 2
    assert f["error_codes"] == {"wrong answer": 2}
    assert f["latency"]["p50_us"] == 4000.0
    assert f["answers"]["checked"] == 4002
    assert f["answers"]["wrong"] == 2
    # server 0.5 s/s and clients 2 x 0.5 s over a 2 s window = 0.5 s/s, at 2000 answers/s
    assert f["cpu_us_per_request"] == {"server": 250.0, "clients": 250.0, "host": 500.0}
    assert f["gpu_busy_pct"] == 90.0  # the readings inside the common window 100.1 .. 102.0
    assert stats.best([{"per_s": 1.0}, {"per_s": 3.0}, {"per_s": 2.0}]) == {"per_s": 3.0}


def test_cpu_per_request_is_missing_without_answers_or_server_readings() -> None:
    assert stats.cpu_per_request(None, 1.0, 100.0) == {"server": None, "clients": 10000.0, "host": None}
    assert stats.cpu_per_request(1.0, 1.0, 0.0) == {"server": None, "clients": None, "host": None}


# ---- table ------------------------------------------------------------------------------------------------------


def _figs(per_s: float, p50_ms: float, wrong: int = 0) -> dict[str, object]:
    return {"processes": 16, "in_flight_per_process": [48] * 16, "per_s": per_s,
            "latency": {"p50_us": p50_ms * 1e3, "p99_us": p50_ms * 2e3}, "gpu_busy_pct": 97.0,
            "cpu_us_per_request": {"server": 10.0, "clients": 90.0, "host": 100.0},
            "answers": {"checked": 100, "wrong": wrong, "max_abs_diff": 1e-3, "first_wrong": ""}}


def _route(client: str, per_s: float, c1_ms: float, wrong: int = 0) -> dict[str, object]:
    best = _figs(per_s, 10.0, wrong)
    return {"client": client, "c1": _figs(per_s / 100, c1_ms), "saturation": [best], "best": best}


def _doc(ring: float, peer: float, ring_c1: float = 0.5, peer_c1: float = 1.0, card: str = "NVIDIA H100",
         wrong: int = 0) -> dict[str, object]:
    return {"date": "2026-12-06T10:00:00Z", "device_name": card, "peers_run": ["shmbroker", "pytriton"],
            "settings": {"model": "nsfw", "engine": "inductor", "max_batch": 256, "max_queue_delay_us": 1000,
                         "duration_s": 5.0},
            "inprocess": {"device_limit": {"items_per_s": 46000.0, "best_batch": 256},
                          "runner_limit": {"items_per_s": 40000.0, "best_batch": 256}},
            "servers": {"shmbroker": {"label": "shmbroker", "routes": {"ring": _route("Client.call", ring, ring_c1)}},
                        "pytriton": {"label": "PyTriton", "routes": {"grpc": _route("gRPC", peer, peer_c1, wrong)}},
                        "litserve": {"label": "LitServe", "error": "LitServe exited with code 1\nTraceback"}}}


def test_the_table_has_a_row_per_route_a_failed_server_and_the_acceptance_lines() -> None:
    text = table.render([_doc(ring=44_000.0, peer=8_000.0)])
    lines = text.splitlines()
    assert lines[0] == "#### NVIDIA H100"
    assert table.HEADER in lines
    ring = next(x for x in lines if x.startswith("| shmbroker |"))
    assert "| **0.50** |" in ring
    assert "| **44,000** |" in ring
    assert "| 16 x 48 |" in ring
    assert "| 100 (10 + 90) |" in ring
    assert "| 97 % |" in ring
    assert any(x.startswith("| LitServe | - | failed: LitServe exited with code 1 |") for x in lines)
    assert "Ring client over the best peer (PyTriton, gRPC): **5.50 x** answers/s (target >= 1.5: met)." in text
    assert "ring client p50 0.50 ms, lowest peer 1.00 ms (PyTriton, gRPC): met." in text
    assert "in-process limit 46,000 images/s at batch 256" in text


def test_a_peer_that_wins_a_column_is_named_and_set_in_bold() -> None:
    text = table.render([_doc(ring=10_000.0, peer=12_000.0, ring_c1=2.0, peer_c1=1.0)])
    peer = next(x for x in text.splitlines() if x.startswith("| PyTriton |"))
    assert "| **1.00** |" in peer
    assert "| **12,000** |" in peer
    assert "(target >= 1.5: MISSED)" in text
    assert "A peer wins the throughput column: PyTriton (gRPC)." in text
    assert "MISSED; a peer wins the c=1 p50 column" in text


def test_wrong_answers_take_a_row_out_of_the_comparison() -> None:
    text = table.render([_doc(ring=10_000.0, peer=50_000.0, wrong=3)])
    assert "PyTriton (gRPC): 3 wrong answers; its figures do not count." in text
    assert "Acceptance: not judged (no peer row)." in text


def test_documents_of_one_card_share_a_table_and_other_cards_get_their_own(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    docs = [_doc(30_000.0, 5_000.0, ring_c1=0.5), _doc(40_000.0, 10_000.0, ring_c1=0.9),
            _doc(5.0, 6.0, card="NVIDIA H200")]
    text = table.render(docs)
    assert text.count("#### NVIDIA H100") == 1
    assert text.count("#### NVIDIA H200") == 1
    h100 = text.split("#### NVIDIA H200")[0]
    assert "| shmbroker (run 1) | Client.call |" in h100
    assert "| **40,000** |" in next(x for x in h100.splitlines() if x.startswith("| shmbroker (run 2) |"))
    # the cautious comparison: the slowest run's ring client against the best peer of any run
    assert "Ring client (its slowest run, 1) over the best peer (PyTriton, gRPC): **3.00 x**" in h100
    assert "Concurrency 1: ring client p50 0.90 ms, lowest peer 1.00 ms" in h100
    assert "Run 1: its ring client over the best peer (PyTriton, gRPC): **6.00 x**" in h100
    assert "Run 2: its ring client over the best peer (PyTriton, gRPC): **4.00 x**" in h100
    assert "- Run 2, 2026-12-06T10:00:00Z (shmbroker, pytriton): in-process limit 46,000" in h100
    paths = []
    for i, d in enumerate(docs):
        paths.append(tmp_path / f"{i}.json")
        paths[-1].write_text(json.dumps(d))
    assert table.main([str(p) for p in paths]) == 0
    assert capsys.readouterr().out == text
    assert table.main([str(tmp_path / "gone.json")]) == 2


# ---- load: request bodies ---------------------------------------------------------------------------------------

MI = {"input_name": "input:0", "input_shape": [3], "input_dtype": "float32", "output_name": "outputs",
      "output_shape": [2], "output_dtype": "float32"}


def test_kserve_bodies_carry_each_row_as_binary_data_and_answers_are_read_back() -> None:
    rows = np.arange(6, dtype=np.float32).reshape(2, 3)
    reqs = load.kserve_requests({"url": "http://h/v2/models/m/infer", "rows": rows, "model_info": MI})
    assert len(reqs) == 2
    url, body, headers = reqs[1]
    assert url == "http://h/v2/models/m/infer"
    n = int(headers["Inference-Header-Content-Length"])
    doc = json.loads(body[:n])
    assert doc["inputs"] == [{"name": "input:0", "datatype": "FP32", "shape": [1, 3],
                              "parameters": {"binary_data_size": 12}}]
    assert np.array_equal(np.frombuffer(body[n:], dtype=np.float32), rows[1])
    out = np.array([0.25, 0.75], dtype=np.float32)
    header = json.dumps({"outputs": [{"name": "outputs", "parameters": {"binary_data_size": 8}}]}).encode()
    assert load.kserve_output(header + out.tobytes(), str(len(header))) == out.tobytes()
    with pytest.raises(ValueError, match="no binary output"):
        load.kserve_output(b"{}", None)


def test_raw_bodies_are_the_rows_bytes() -> None:
    rows = np.arange(6, dtype=np.float32).reshape(2, 3)
    reqs = load.raw_requests({"url": "http://h/infer", "rows": rows})
    assert [r[1] for r in reqs] == [rows[0].tobytes(), rows[1].tobytes()]
    assert reqs[0][2] == {"Content-Type": "application/octet-stream"}


# ---- the FastAPI peer's batcher ---------------------------------------------------------------------------------


class _Doubler:
    """A fake engine instance: twice its input; records its batch sizes; may be told to fail."""

    def __init__(self, fail: bool = False) -> None:
        self.sizes: list[int] = []
        self.fail = fail
        self.threads: set[str] = set()

    def run(self, x: np.ndarray) -> np.ndarray:
        self.sizes.append(len(x))
        self.threads.add(threading.current_thread().name)
        if self.fail:
            raise RuntimeError("engine failed")
        return x * 2

    def close(self) -> None:
        pass


def test_the_batcher_batches_waiting_rows_up_to_max_batch_and_answers_each_its_own() -> None:
    runner = _Doubler()

    async def scenario() -> list[np.ndarray]:
        b = Batcher([runner], max_batch=4, delay_s=0.05)  # type: ignore[list-item]
        task = asyncio.create_task(b.loop())
        try:
            return await asyncio.gather(*(b.infer(np.full(3, k, dtype=np.float32)) for k in range(10)))
        finally:
            task.cancel()

    outs = asyncio.run(scenario())
    assert [float(o[0]) for o in outs] == [2.0 * k for k in range(10)]
    assert sum(runner.sizes) == 10
    assert max(runner.sizes) == 4
    assert runner.threads and all(t.startswith("batch") for t in runner.threads)  # off the event loop


def test_an_engine_error_reaches_every_request_of_its_batch() -> None:
    async def scenario() -> list[object]:
        b = Batcher([_Doubler(fail=True)], max_batch=8, delay_s=0.01)  # type: ignore[list-item]
        task = asyncio.create_task(b.loop())
        try:
            results: list[object] = await asyncio.gather(
                *(b.infer(np.zeros(3, dtype=np.float32)) for _ in range(3)), return_exceptions=True)
            return results
        finally:
            task.cancel()

    results = asyncio.run(scenario())
    assert all(isinstance(r, RuntimeError) and str(r) == "engine failed" for r in results)


# ---- packing and options ----------------------------------------------------------------------------------------


def test_packing_drops_only_other_pythons_stubs_and_bundled_libpython() -> None:
    stub = pack.STUBS
    assert pack.dropped(f"{stub}3.8/triton_python_backend_stub", "3.12")
    assert pack.dropped(f"{stub}3.13/", "3.12")
    assert not pack.dropped(f"{stub}3.12/triton_python_backend_stub", "3.12")
    assert not pack.dropped(stub, "3.12")
    assert pack.dropped("nvidia_pytriton.libs/libpython3-419a3a08.13.so.1.0", "3.12")
    assert not pack.dropped("nvidia_pytriton.libs/libpython3-419a3a08.13.so.1.0", "3.13")
    assert not pack.dropped("nvidia_pytriton.libs/libtritonserver-717102f0.so", "3.12")
    assert not pack.dropped("pytriton/tritonserver/bin/tritonserver", "3.12")


def test_groups_list_each_pin_once_and_an_unknown_group_is_named() -> None:
    reqs = pack.requirements(["web", "pytriton"])
    assert reqs.count("importlib-metadata==10.2.0") == 1
    assert "nvidia-pytriton==0.7.0" in reqs
    with pytest.raises(ValueError, match=r"unknown group \['ray'\]"):
        pack.requirements(["ray"])


def test_options_are_checked_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    args = run.parse(["--peers", "fastapi,shmbroker", "--in-flight", "8,48"])
    assert args.peer_list == ["fastapi", "shmbroker"]
    assert args.depths == [8, 48]
    for bad, what in ((["--peers", "ray"], "--peers: unknown ['ray']"), (["--in-flight", "x"], "--in-flight"),
                      (["--processes", "0"], "--processes must be at least 1"),
                      (["--engine", "inductor"], "--engine inductor needs --package")):
        with pytest.raises(SystemExit):
            run.parse(bad)
        assert what in capsys.readouterr().err


def test_the_sampler_reads_once_more_when_stopped_so_a_window_that_just_ended_is_covered() -> None:
    import os
    import time

    from shmbroker.bench.peers.servers import Sampler

    sampler = Sampler([os.getpid()], None, period_s=60.0)  # one reading at the start, the next a minute later
    sampler.start()
    assert sampler.first.wait(30.0)
    window_end = time.monotonic()
    sampler.stop()
    assert not sampler.is_alive()
    assert sampler.cpu[-1][0] >= window_end
    assert stats.delta(sampler.cpu, sampler.cpu[0][0], window_end) is not None
