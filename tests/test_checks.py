"""client.checks: a timeout must fit the wire's u32 microseconds; None means the model's default."""

from __future__ import annotations

import pytest

from client import BadInput
from client.checks import MAX_TIMEOUT_S, check_timeout


@pytest.mark.parametrize("timeout", [None, 1e-6, 1.0, MAX_TIMEOUT_S])
def test_accepted_timeouts(timeout: float | None) -> None:
    check_timeout(timeout)


@pytest.mark.parametrize("timeout", [0, -1.0, MAX_TIMEOUT_S * 1.001, float("nan")])
def test_rejected_timeouts(timeout: float) -> None:
    with pytest.raises(BadInput, match="timeout: expected 0 < timeout"):
        check_timeout(timeout)
