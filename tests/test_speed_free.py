"""No test depends on the machine's speed: every Hypothesis test runs without a per-example deadline and
without the too-slow health check (the profile in conftest.py, which a test's own @settings must not undo)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest
from hypothesis import HealthCheck

TESTS = Path(__file__).resolve().parent


def _hypothesis_modules() -> list[str]:
    return sorted(f"tests.{p.stem}" for p in TESTS.glob("test_*.py")
                  if any(isinstance(n, ast.ImportFrom) and n.module == "hypothesis"
                         for n in ast.walk(ast.parse(p.read_text()))))


@pytest.mark.parametrize("module", _hypothesis_modules())
def test_hypothesis_tests_have_no_deadline(module: str) -> None:
    mod = importlib.import_module(module)
    tests = {name: fn for name, fn in vars(mod).items() if name.startswith("test_") and hasattr(fn, "hypothesis")}
    for name, fn in tests.items():
        effective = fn._hypothesis_internal_use_settings
        assert effective.deadline is None, f"{module}.{name}: deadline {effective.deadline}"
        assert HealthCheck.too_slow in effective.suppress_health_check, f"{module}.{name}: too_slow is checked"
