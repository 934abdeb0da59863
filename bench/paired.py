"""Interleaved rounds of a subject and its baseline: B S B S ... B, with N subject windows and N + 1 baseline ones.

Each subject window is paired with the two baseline windows on either side of it: that round's ratio is the
subject's figure over their mean, so a drift of the machine's speed cancels out of it. The run's ratio is the
median of the rounds' ratios, so one window that the machine disturbed does not decide it. The merged
measurements keep every window; with one round this is "before, subject, after".
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass

from shmbroker.bench.common import Figures

Phase = Callable[[str, str, Callable[[], Figures], Callable[[Figures], str]], None]


@dataclass(frozen=True)
class Side:
    """One side of a pair: its measurement key, how a window is measured, and how its progress line reads."""

    key: str
    title: str
    measure: Callable[[], Figures]
    summary: Callable[[Figures], str]


@dataclass(frozen=True)
class Pair:
    """A subject measured against a baseline in interleaved windows; ``figures`` are the compared fields
    (``per_s`` at the top level, or ``p50_us``/``p99_us`` under ``latency``)."""

    base: Side
    subject: Side
    figures: tuple[str, ...]


def window_key(key: str, index: int) -> str:
    return f"{key}#{index + 1}"


def run(pair: Pair, rounds: int, phase: Phase) -> None:
    """Measure ``rounds`` rounds through ``phase`` (which stores each window under its ``window_key``)."""
    for i in range(rounds):
        _window(pair.base, i, rounds + 1, phase)
        _window(pair.subject, i, rounds, phase)
    _window(pair.base, rounds, rounds + 1, phase)


def _window(side: Side, index: int, count: int, phase: Phase) -> None:
    phase(window_key(side.key, index), f"{side.title} (window {index + 1} of {count})", side.measure, side.summary)


def figure(f: Figures, name: str) -> float | None:
    value = f.get(name)
    if value is None and isinstance(f.get("latency"), dict):
        value = f["latency"].get(name)
    return float(value) if isinstance(value, int | float) else None


def merge(measurements: dict[str, Figures], pair: Pair, rounds: int) -> None:
    """Replace the windows of both sides by one measurement each; the subject's gets ``paired``, its ratios.

    A side with a failed window becomes that failure (the bench already listed it among its failures).
    """
    base = _collect(measurements, pair.base.key, rounds + 1)
    subject = _collect(measurements, pair.subject.key, rounds)
    if isinstance(base, list):
        measurements[pair.base.key] = _merged(base, pair.figures)
    else:
        measurements[pair.base.key] = base
    if not isinstance(subject, list):
        measurements[pair.subject.key] = subject
        return
    merged = _merged(subject, pair.figures)
    if isinstance(base, list):
        merged["paired"] = paired_ratios(base, subject, pair.base.key, pair.figures)
    measurements[pair.subject.key] = merged


def _collect(measurements: dict[str, Figures], key: str, count: int) -> list[Figures] | Figures:
    """The windows of ``key`` in order (removed from ``measurements``), or the first failed one."""
    windows = [measurements.pop(window_key(key, i), {"error": "not measured"}) for i in range(count)]
    failed = next((w for w in windows if "error" in w), None)
    return failed if failed is not None else windows


def _merged(windows: list[Figures], names: tuple[str, ...]) -> Figures:
    """The window whose first figure is the median one, with each compared figure set to the median of the
    windows', the errors summed, and every window kept under ``windows``."""
    first = names[0]
    order = sorted(range(len(windows)), key=lambda i: figure(windows[i], first) or 0.0)
    out: Figures = {**windows[order[(len(order) - 1) // 2]]}
    if "latency" in out:
        out["latency"] = {**out["latency"]}
    for name in names:
        holder = out["latency"] if name in out.get("latency", {}) else out
        holder[name] = round(statistics.median(figure(w, name) or 0.0 for w in windows), 2)
    if any("errors" in w for w in windows):  # an in-process window has no requests, so no errors field
        out["errors"] = sum(int(w.get("errors", 0)) for w in windows)
    out["windows"] = windows
    return out


def paired_ratios(base: list[Figures], subject: list[Figures], against: str, names: tuple[str, ...]) -> Figures:
    """Per compared figure: each round's subject / mean(baseline before, baseline after), and their median."""
    out: Figures = {"against": against, "rounds": len(subject)}
    for name in names:
        per_round = []
        for i, s in enumerate(subject):
            a, b, v = figure(base[i], name), figure(base[i + 1], name), figure(s, name)
            if a is not None and b is not None and v is not None and a + b > 0:
                per_round.append(round(v / ((a + b) / 2), 3))
        out[name] = {"per_round": per_round,
                     "median": round(statistics.median(per_round), 3) if per_round else None}
    return out
