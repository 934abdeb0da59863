"""Checks of a call that need no session state: the timeout's range (``check_timeout``), and ``FORKS``,
bumped in a forked child so that a Client's per-request fork check needs no getpid() call."""

from __future__ import annotations

import os

from client.errors import BadInput

MAX_TIMEOUT_S = 0xFFFF_FFFF / 1e6  # timeout_us is a u32 on the wire


def check_timeout(timeout: float | None) -> None:
    if timeout is not None and not 0 < timeout <= MAX_TIMEOUT_S:
        raise BadInput(f"timeout: expected 0 < timeout <= {MAX_TIMEOUT_S:.0f} s (or None: the model's default), "
                       f"got {timeout}")


FORKS = [0]  # bumped in a forked child, so the per-request fork check needs no getpid() call
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=lambda: FORKS.__setitem__(0, FORKS[0] + 1))
