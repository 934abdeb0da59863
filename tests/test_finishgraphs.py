"""gpu_worker/finishgraphs.py without a device: the row buckets, and FusedFinish where the compiler fails (the
finish step runs the eager recipe, says so once, and gives its rows) or works (the graphs themselves and the
compiled rows: tests/gpu/test_finishgraphs.py)."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from shmbroker.gpu_worker.finishgraphs import FusedFinish, buckets


def test_buckets_are_powers_of_two_then_the_rows() -> None:
    assert buckets(1) == [1]
    assert buckets(12) == [1, 2, 4, 8, 12]
    assert buckets(16) == [1, 2, 4, 8, 16]


class Rows:
    def __init__(self, crops: Any) -> None:
        self.crops = crops

    def to(self, dtype: str) -> tuple[str, Any, str]:
        return ("rows", self.crops, dtype)


class Recipe:
    def __init__(self) -> None:
        self.calls = 0

    def finish(self, crops: Any) -> Rows:
        self.calls += 1
        return Rows(crops)


class FailingCompiler:
    """torch as FusedFinish uses it, whose compiled functions raise as a compiler without a toolchain does."""

    float32 = "float32"

    def __init__(self) -> None:
        self.compiled_calls = 0

    def compile(self, fn: Any, **kwargs: Any) -> Any:
        def compiled(crops: Any) -> Any:
            self.compiled_calls += 1
            raise RuntimeError("InductorError: no C compiler\nmore")
        return compiled


def test_a_failing_compile_falls_back_to_the_eager_recipe_once(caplog: pytest.LogCaptureFixture) -> None:
    torch, recipe = FailingCompiler(), Recipe()
    fused = FusedFinish(torch, recipe)
    with caplog.at_level(logging.WARNING, logger="shmbroker.gpu_worker.finishgraphs"):
        assert fused(1) == ("rows", 1, "float32")
        assert fused(2) == ("rows", 2, "float32")
    assert not fused.compiled and torch.compiled_calls == 1
    warnings = [r.getMessage() for r in caplog.records]
    assert warnings == ["the photo recipe's finish step runs eager: torch.compile failed "
                        "(RuntimeError: InductorError: no C compiler)"]


class WorkingCompiler(FailingCompiler):
    def compile(self, fn: Any, **kwargs: Any) -> Any:
        self.kwargs = kwargs

        def compiled(crops: Any) -> Any:
            self.compiled_calls += 1
            return fn(crops)
        return compiled


def test_the_compiled_function_serves_every_call_after_one_eager_priming() -> None:
    torch, recipe = WorkingCompiler(), Recipe()
    fused = FusedFinish(torch, recipe)
    assert [fused(n) for n in (1, 5, 5)] == [("rows", n, "float32") for n in (1, 5, 5)]
    assert fused.compiled and torch.compiled_calls == 3
    assert recipe.calls == 4  # the priming call, then one a call through the compiled function
    assert torch.kwargs == {"dynamic": True, "fullgraph": True}
