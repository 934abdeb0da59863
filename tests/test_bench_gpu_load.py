"""bench.gpu_load: the worker's figures of a window are the difference of two stats snapshots, and a client
process counts the answers inside its window with either API, against a real broker."""

from __future__ import annotations

import collections

import pytest

from shmbroker.bench import gpu_load
from shmbroker.broker.common import protocol as P
from shmbroker.client.receiving import IO_THREAD_NAME
from shmbroker.gpu_worker.model_source import TINY_WIDTH
from tests.conftest import RunningBroker


def _reply(batch_items: dict[str, int], compute_us: float) -> P.StatsReply:
    batches = sum(batch_items.values())
    compute = P.StageHistogram([1000.0], [batches, 0], batches, compute_us, 900.0)
    model = P.ModelStats("nsfw", {"OK": 0}, batches, batch_items, 0, {"compute": compute})
    return P.StatsReply([P.WorkerStats(0, 1, 0, [model])])


def test_batch_sizes_and_compute_of_the_window_only() -> None:
    before = _reply({"1": 5, "192": 2}, 2000.0)
    after = _reply({"1": 5, "192": 6, "256": 4}, 12_000.0)
    out = gpu_load.stage_figures(before, after, "nsfw", 0.5)
    assert out["batches"] == 8
    assert out["batch_sizes"] == {"192": 4, "256": 4}  # sizes with no batch in the window are left out
    assert out["mean_batch"] == 224.0
    assert out["compute_busy_pct"] == 2.0  # 10 ms of event-timed compute in 0.5 s


def _snapshot(t: float, requests: int, cpu: float, preempted: float, host: dict[str, float],
              batch_items: dict[str, int] | None = None) -> gpu_load.Snapshot:
    reply = _reply(batch_items or {"1": 1}, 0.0)
    reply.workers[0].models[0].requests["OK"] = requests
    times = collections.namedtuple("times", list(host))(**host)  # psutil.cpu_times()'s shape
    return gpu_load.Snapshot(t, reply, {7: {"runner": cpu}}, {}, {7: {"runner": preempted}}, times)


def test_the_worker_and_machine_figures_of_a_window() -> None:
    before = _snapshot(1.0, 1000, 2.0, 10, {"user": 10.0, "system": 2.0, "idle": 50.0, "iowait": 0.0,
                                           "steal": 1.0, "guest": 0.0})
    after = _snapshot(2.0, 11_000, 2.05, 30, {"user": 14.0, "system": 3.0, "idle": 54.0, "iowait": 1.0,
                                             "steal": 2.0, "guest": 3.0})
    assert gpu_load.worker_cpu(before, after, "nsfw") == {"7": {"runner": 5.0, "total": 5.0}}
    assert gpu_load.worker_cpu(before, after, "nsfw", "preempted") == {"7": {"runner": 2.0, "total": 2.0}}
    assert gpu_load.worker_cpu(before, after, "nsfw", "waits") == {}  # this kernel kept no run-queue delay
    # 11 s of CPU time passed: 5 busy (guest time is inside user), 5 idle or waiting on IO, 1 stolen
    assert gpu_load.host_cpu(before, after) == {"busy_pct": 45.5, "steal_pct": 9.09}


def test_the_time_outside_the_workers_stages_is_what_the_latency_leaves() -> None:
    stages = {k: {"mean_us": 1000.0} for k in gpu_load.WORKER_STAGES}
    assert gpu_load.outside_worker_ms({"mean_us": 9500.0}, stages) == 3.5
    del stages["answer"]
    assert gpu_load.outside_worker_ms({"mean_us": 9500.0}, stages) is None  # a CPU worker has no stages


@pytest.mark.parametrize("api", ["call", "infer", "request"])
def test_a_client_process_counts_its_windows_answers_with_each_api(broker: RunningBroker, api: str) -> None:
    spec = {"index": 0, "seed": 1, "shape": [1, TINY_WIDTH], "warmup_s": 0.1, "duration_s": 0.5,
            "runtime_dir": str(broker.runtime_dir), "model": "tiny", "in_flight": 3, "api": api,
            "warmup_requests": 2}
    out = gpu_load.client(spec, lambda: None)
    assert out["errors"] == 0 and out["lost"] == 0, out["error_codes"]
    assert out["completed"] == len(out["samples_ns"]) > 0
    assert out["answered"] >= out["completed"]  # and the answers of the warm-up and the drain, outside the window
    assert out["preempted"] >= 0 and out["cpu_s"] > 0
    w0, w1 = out["window_monotonic"]
    assert w1 - w0 == spec["duration_s"]
    assert all(0 < ns < 2e9 for ns in out["samples_ns"])  # each within the model's 2 s timeout
    by_thread = out["cpu_s_by_thread"]  # the client's receiving thread by its name, the test's own as "caller"
    assert IO_THREAD_NAME in by_thread and "caller" in by_thread, by_thread
    assert ("ended" in by_thread) == (api != "call")  # the loops' extra caller threads end with the window
    assert all(sec >= 0 for sec in by_thread.values())


def test_the_clients_cpu_by_thread_is_summed_over_processes_per_answer() -> None:
    results = [{"answered": 100, "cpu_s_by_thread": {IO_THREAD_NAME: 0.004, "ZMQbg/IO/0": 0.001, "caller": 0.0}},
               {"answered": 300, "cpu_s_by_thread": {IO_THREAD_NAME: 0.008, "ZMQbg/IO/0": 0.003}}]
    assert gpu_load.client_threads(results) == {IO_THREAD_NAME: 30.0, "ZMQbg/IO/0": 10.0, "total": 40.0}



def test_answer_bursts_count_wake_ups_and_their_gaps() -> None:
    b = gpu_load.BurstGaps()
    t = 10_000_000
    for gap_us in (0, 10, 10, 500, 10, 2500, 6000, 700):  # 0 and 10: the same burst
        t += gap_us * 1000
        b.add(t)
    assert b.counts() == {"answers": 8, "bursts": 5, "within_1ms": 2, "within_4ms": 1}
    merged = gpu_load.BurstGaps.merge([b.counts(), {"answers": 2, "bursts": 1, "within_1ms": 0, "within_4ms": 1}])
    assert merged == {"answers_per_burst": 1.67, "gaps_within_1ms_pct": 33.3, "gaps_1_to_4ms_pct": 33.3}
    assert gpu_load.BurstGaps.merge([{"answers": 0, "bursts": 0, "within_1ms": 0, "within_4ms": 0}]) is None


def test_the_worker_cpu_per_row_of_requests_of_several_rows() -> None:
    host = {"user": 1.0, "idle": 1.0}
    before = _snapshot(1.0, 100, 2.0, 0, host, {"8": 100})  # 100 requests of 8 photos: 100 batches of 8 rows
    after = _snapshot(2.0, 200, 2.08, 0, host, {"8": 100, "16": 50})  # 100 more, in batches of 16
    assert gpu_load.worker_cpu(before, after, "nsfw") == {"7": {"runner": 800.0, "total": 800.0}}
    assert gpu_load.worker_cpu(before, after, "nsfw", per="row") == {"7": {"runner": 100.0, "total": 100.0}}
