"""Every answer of every server, checked against the engine's own output for the same input (pure; no IO).

A client sends the rows of a small fixed set in turn; the driver ran each row alone in-process on the same
engine (``engine.reference``). An answer counts as right when it has the reference's shape and no element
differs from it by more than the tolerance: batching changes which kernels run, so a GPU engine in fp16 may
move the last digits, and nothing more.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

DEFAULT_TOLERANCE = {"cpu": 1e-4, "gpu": 2e-2}  # max abs difference; fp16 kernels at other batch sizes on a GPU


class AnswerError(ValueError):
    """Reference rows and inputs that do not pair up; the text says which counts differ."""


@dataclass
class Tally:
    """What one client saw: answers checked, wrong ones (bad shape or too far), the largest difference."""

    checked: int = 0
    wrong: int = 0
    max_abs_diff: float = 0.0
    first_wrong: str = ""  # the first wrong answer, described, for the report

    def add(self, other: Tally) -> None:
        self.checked += other.checked
        self.wrong += other.wrong
        self.max_abs_diff = max(self.max_abs_diff, other.max_abs_diff)
        self.first_wrong = self.first_wrong or other.first_wrong

    def as_dict(self) -> dict[str, Any]:
        return {"checked": self.checked, "wrong": self.wrong, "max_abs_diff": float(self.max_abs_diff),
                "first_wrong": self.first_wrong}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Tally:
        return cls(int(d["checked"]), int(d["wrong"]), float(d["max_abs_diff"]), str(d.get("first_wrong", "")))


@dataclass
class Checker:
    """Checks answer ``k`` against reference row ``k % len(reference)``; ``tally`` accumulates."""

    reference: np.ndarray  # [rows, *output row]
    tolerance: float
    tally: Tally = field(default_factory=Tally)

    def __post_init__(self) -> None:
        if self.tolerance < 0 or not np.isfinite(self.tolerance):
            raise AnswerError(f"tolerance must be a finite number >= 0, got {self.tolerance} (--tolerance)")

    def check(self, row: int, answer: np.ndarray) -> bool:
        """Whether ``answer`` (one row, with or without its batch dimension of 1) matches reference ``row``."""
        want = self.reference[row % len(self.reference)]
        got = answer.reshape(answer.shape[1:]) if answer.ndim == want.ndim + 1 and answer.shape[0] == 1 else answer
        self.tally.checked += 1
        if got.shape != want.shape:
            return self._wrong(f"row {row}: shape {list(got.shape)}, expected {list(want.shape)}")
        diff = float(np.max(np.abs(got.astype(np.float64) - want.astype(np.float64)))) if want.size else 0.0
        if not np.isfinite(diff):
            return self._wrong(f"row {row}: not finite ({got.ravel()[:4].tolist()} ...)")
        self.tally.max_abs_diff = max(self.tally.max_abs_diff, diff)
        if diff > self.tolerance:
            return self._wrong(f"row {row}: max abs difference {diff:.3g} > tolerance {self.tolerance:g}")
        return True

    def check_bytes(self, row: int, body: bytes, dtype: str) -> bool:
        """An answer that came as the raw bytes of one output row."""
        want = self.reference[row % len(self.reference)]
        if len(body) != want.size * np.dtype(dtype).itemsize:
            self.tally.checked += 1
            return self._wrong(f"row {row}: {len(body)} bytes, expected {want.size * np.dtype(dtype).itemsize}")
        return self.check(row, np.frombuffer(body, dtype=dtype).reshape(want.shape))

    def unreadable(self, row: int, what: str) -> bool:
        """An answer that could not be read as an output row at all: checked, and wrong."""
        self.tally.checked += 1
        return self._wrong(f"row {row}: unreadable answer: {what}")

    def _wrong(self, what: str) -> bool:
        self.tally.wrong += 1
        self.tally.first_wrong = self.tally.first_wrong or what
        return False


def pair(rows: np.ndarray, reference: np.ndarray) -> None:
    """Refuse inputs and references of different counts (a driver bug, said plainly)."""
    if len(rows) != len(reference) or len(rows) == 0:
        raise AnswerError(f"{len(rows)} input rows and {len(reference)} reference rows: they must pair up, "
                          "at least one")
