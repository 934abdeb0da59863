"""bench.paired: the interleaved schedule, the merged windows and the rounds' ratios that the targets use."""

from __future__ import annotations

from collections.abc import Callable

from shmbroker.bench import paired, report
from shmbroker.bench.common import Figures


def _side(key: str, values: list[float], latency: bool = False) -> paired.Side:
    """A side whose successive windows report ``values`` (as per_s, or as latency p50 with p99 = 10 x p50)."""
    feed = iter(values)

    def measure() -> Figures:
        v = next(feed)
        if latency:
            return {"errors": 0, "latency": {"p50_us": v, "p99_us": 10 * v, "samples": 100}}
        return {"errors": 1, "per_s": v}

    return paired.Side(key, key.replace("_", " "), measure, lambda f: "")


def _recorder(store: dict[str, Figures], order: list[str]) -> paired.Phase:
    def phase(key: str, title: str, fn: Callable[[], Figures], summary: Callable[[Figures], str]) -> None:
        order.append(title)
        store[key] = fn()

    return phase


def test_rounds_alternate_baseline_and_subject_and_start_and_end_on_the_baseline():
    store: dict[str, Figures] = {}
    order: list[str] = []
    pair = paired.Pair(_side("echo_throughput", [1, 2, 3, 4]), _side("tiny_throughput", [5, 6, 7]), ("per_s",))
    paired.run(pair, 3, _recorder(store, order))
    assert order == ["echo throughput (window 1 of 4)", "tiny throughput (window 1 of 3)",
                     "echo throughput (window 2 of 4)", "tiny throughput (window 2 of 3)",
                     "echo throughput (window 3 of 4)", "tiny throughput (window 3 of 3)",
                     "echo throughput (window 4 of 4)"]
    assert sorted(store) == ["echo_throughput#1", "echo_throughput#2", "echo_throughput#3", "echo_throughput#4",
                             "tiny_throughput#1", "tiny_throughput#2", "tiny_throughput#3"]


def test_each_round_pairs_the_subject_with_the_baselines_either_side_and_the_target_takes_the_median():
    store: dict[str, Figures] = {}
    # the machine slows down between rounds; the subject is always 1.1 x its neighbours' mean except in a
    # disturbed middle round, which the median ignores
    pair = paired.Pair(_side("echo_throughput", [1000, 800, 600, 400]),
                       _side("tiny_throughput", [990, 350, 550]), ("per_s",))
    paired.run(pair, 3, _recorder(store, []))
    paired.merge(store, pair, 3)
    assert sorted(store) == ["echo_throughput", "tiny_throughput"]
    echo, tiny = store["echo_throughput"], store["tiny_throughput"]
    assert echo["per_s"] == 700.0  # median of 4 windows: the mean of the middle two
    assert [w["per_s"] for w in echo["windows"]] == [1000, 800, 600, 400]
    assert echo["errors"] == 4 and tiny["errors"] == 3
    assert tiny["per_s"] == 550.0
    assert tiny["paired"]["against"] == "echo_throughput"
    assert tiny["paired"]["per_s"]["per_round"] == [1.1, 0.5, 1.1]
    assert tiny["paired"]["per_s"]["median"] == 1.1
    # the target is the paired median, not median(tiny) / median(echo) = 0.786
    r = report.ratios(store)["tiny_throughput_over_echo_throughput"]
    assert r["value"] == 1.1 and r["pass"] is True


def test_latency_pairs_compare_p50_and_p99_and_one_round_is_before_subject_after():
    store: dict[str, Figures] = {}
    pair = paired.Pair(_side("echo_latency", [100, 140], latency=True), _side("tiny_latency", [180], latency=True),
                       ("p50_us", "p99_us"))
    paired.run(pair, 1, _recorder(store, []))
    paired.merge(store, pair, 1)
    echo, tiny = store["echo_latency"], store["tiny_latency"]
    assert echo["latency"]["p50_us"] == 120.0 and echo["latency"]["p99_us"] == 1200.0
    assert tiny["paired"]["p50_us"] == {"per_round": [1.5], "median": 1.5}
    assert report.ratios(store)["tiny_p50_over_echo_p50"]["value"] == 1.5
    assert report.info_ratios(store)["tiny_p99_over_echo_p99"] == 1.5
    assert "rounds' ratios" not in report._window_notes(tiny)  # one round: no list to show


def test_a_failed_window_fails_its_side_and_leaves_no_ratio():
    store: dict[str, Figures] = {}
    pair = paired.Pair(_side("echo_throughput", [1000, 900, 800]), _side("tiny_throughput", [1000, 900]), ("per_s",))
    paired.run(pair, 2, _recorder(store, []))
    store["echo_throughput#2"] = {"error": "a client process failed"}
    paired.merge(store, pair, 2)
    assert store["echo_throughput"] == {"error": "a client process failed"}
    assert "paired" not in store["tiny_throughput"]
    r = report.ratios(store)["tiny_throughput_over_echo_throughput"]
    assert r["value"] is None and r["pass"] is False
