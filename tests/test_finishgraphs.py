"""gpu_worker/finishgraphs.py without a device: the row buckets, and FusedFinish where the compiler fails (the
finish step runs the eager recipe, says so once, and gives its rows) or works (the graphs themselves and the
compiled rows: tests/gpu/test_finishgraphs.py)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import pytest

from shmbroker.gpu_worker.finishgraphs import FusedFinish, buckets


def test_buckets_are_powers_of_two_then_the_rows() -> None:
    assert buckets(1) == [1]
    assert buckets(12) == [1, 2, 4, 8, 12]
    assert buckets(16) == [1, 2, 4, 8, 16]


@dataclasses.dataclass(frozen=True)
class Crops:
    """A batch of ``n`` crops, as FusedFinish sees it (its shape)."""

    n: int

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.n, 3, 224, 224)


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
        assert fused(Crops(4)) == ("rows", Crops(4), "float32")
        assert fused(Crops(2)) == ("rows", Crops(2), "float32")
    assert not fused.compiled and torch.compiled_calls == 1
    warnings = [r.getMessage() for r in caplog.records]
    assert warnings == ["the photo recipe's finish step runs eager: torch.compile failed "
                        "(RuntimeError: InductorError: no C compiler)"]


class NoCompiler(FailingCompiler):
    """torch where ``torch.compile`` itself refuses (a Python version Dynamo does not support)."""

    def compile(self, fn: Any, **kwargs: Any) -> Any:
        raise RuntimeError("torch.compile is not supported on Python 3.14+")


def test_a_refused_compile_runs_the_eager_recipe(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="shmbroker.gpu_worker.finishgraphs"):
        fused = FusedFinish(NoCompiler(), Recipe())
    assert not fused.compiled and fused(Crops(3)) == ("rows", Crops(3), "float32")
    assert [r.getMessage() for r in caplog.records] == [
        "the photo recipe's finish step runs eager: torch.compile failed "
        "(RuntimeError: torch.compile is not supported on Python 3.14+)"]


class WorkingCompiler(FailingCompiler):
    def compile(self, fn: Any, **kwargs: Any) -> Any:
        self.kwargs = kwargs

        def compiled(crops: Any) -> Any:
            self.compiled_calls += 1
            return fn(crops)
        return compiled


def test_the_compiled_function_serves_every_batch_of_two_rows_or_more() -> None:
    torch, recipe = WorkingCompiler(), Recipe()
    fused = FusedFinish(torch, recipe)
    sizes = (1, 5, 1, 2)
    assert [fused(Crops(n)) for n in sizes] == [("rows", Crops(n), "float32") for n in sizes]
    assert fused.compiled and torch.compiled_calls == 2  # 5 and 2; a lone row runs eager
    assert recipe.calls == 4  # one a call: the first lone row's eager call primed the recipe's constants
    assert torch.kwargs == {"dynamic": True, "fullgraph": True}


def test_the_first_compiled_call_says_it_compiles_and_how_long(caplog: pytest.LogCaptureFixture,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/var/cache/shmbroker/inductor")
    fused = FusedFinish(WorkingCompiler(), Recipe())
    with caplog.at_level(logging.INFO, logger="shmbroker.gpu_worker.finishgraphs"):
        for n in (1, 4, 2, 8):
            fused(Crops(n))
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2, messages  # the compile is said once, not at each call
    assert messages[0] == ("compiling the photo recipe's finish step with TorchInductor, once: its cache "
                           "(/var/cache/shmbroker/inductor) keeps the kernels for later starts")
    assert messages[1].startswith("the photo recipe's finish step compiled in ")
