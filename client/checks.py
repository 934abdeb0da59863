"""Checks of a call that need no session state: the timeout's range (``check_timeout``), a request's inputs
against the model (``checked_arrays``, the checks that name the field), and ``FORKS``, bumped in a forked
child so that a Client's per-request fork check needs no getpid() call."""

from __future__ import annotations

import os
from collections.abc import Mapping

import numpy as np

from client.errors import BadInput
from client.session import ModelPlan

MAX_TIMEOUT_S = 0xFFFF_FFFF / 1e6  # timeout_us is a u32 on the wire


def check_timeout(timeout: float | None) -> None:
    if timeout is not None and not 0 < timeout <= MAX_TIMEOUT_S:
        raise BadInput(f"timeout: expected 0 < timeout <= {MAX_TIMEOUT_S:.0f} s (or None: the model's default), "
                       f"got {timeout}")


FORKS = [0]  # bumped in a forked child, so the per-request fork check needs no getpid() call
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=lambda: FORKS.__setitem__(0, FORKS[0] + 1))


MAX_ITEMS_SETTING = "Client(max_items=...)"


def check_rows(plan: ModelPlan, rows: int, field: str, max_items: int, setting: str = MAX_ITEMS_SETTING) -> None:
    """BadInput (BAD_SHAPE) unless 1 <= rows <= both limits; the message names the one that binds and, for the
    session's, ``setting``: how the caller's interface raises it."""
    if 1 <= rows <= min(plan.info.max_batch, max_items):
        return
    if rows > plan.info.max_batch:
        why = f"model {plan.info.name!r} has max_batch {plan.info.max_batch}"
    elif rows >= 1:
        why = (f"this session takes at most {max_items} rows a request: raise it with {setting}, or the broker's "
               f"[sessions] default_max_items")
    else:
        why = "a request has at least one row"
    raise BadInput(f"{field}: expected 1..{min(plan.info.max_batch, max_items)} rows ({why}), got {rows}",
                   "BAD_SHAPE")


def checked_arrays(plan: ModelPlan, inputs: np.ndarray | Mapping[str, np.ndarray], max_items: int,
                   setting: str = MAX_ITEMS_SETTING) -> list[np.ndarray]:
    """The inputs as arrays in model order, each checked against the model; BadInput names the first fault."""
    specs = plan.info.inputs
    if isinstance(inputs, np.ndarray):
        if len(specs) != 1:
            raise BadInput(f"model {plan.info.name!r} takes inputs {[s.name for s in specs]}; pass a dict")
        inputs = {specs[0].name: inputs}
    extra = set(inputs) - {s.name for s in specs}
    if extra:
        raise BadInput(f"inputs {sorted(extra)}: model {plan.info.name!r} has no such input")
    out: list[np.ndarray] = []
    for k, spec in enumerate(specs):
        if spec.name not in inputs:
            raise BadInput(f"inputs[{spec.name!r}] is missing")
        arr = np.asarray(inputs[spec.name])
        if arr.dtype != plan.in_dtypes[k]:
            raise BadInput(f"inputs[{spec.name!r}].dtype: expected {spec.dtype}, got {arr.dtype}", "BAD_DTYPE")
        if arr.ndim != len(spec.shape) or arr.shape[1:] != plan.in_item_shapes[k]:
            raise BadInput(f"inputs[{spec.name!r}].shape: expected [N, "
                           f"{', '.join(map(str, spec.shape[1:]))}], got {list(arr.shape)}", "BAD_SHAPE")
        if out and arr.shape[0] != out[0].shape[0]:
            raise BadInput(f"inputs[{spec.name!r}].shape[0]: {arr.shape[0]} rows, first input has "
                           f"{out[0].shape[0]}", "BAD_SHAPE")
        check_rows(plan, arr.shape[0], f"inputs[{spec.name!r}].shape[0]", max_items, setting)
        out.append(arr)
    return out
