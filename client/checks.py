"""Checks of a call that need no session state: the timeout's range (``check_timeout``), a request's inputs
against the model (``checked_arrays``, the checks that name the field), and ``FORKS``, bumped in a forked
child so that a Client's per-request fork check needs no getpid() call."""

from __future__ import annotations

import os
from collections.abc import Mapping

import numpy as np

from shmbroker.client.errors import BadInput
from shmbroker.client.session import ImageRow, ModelPlan

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
        why = (f"a zero-copy request fills one slot, and a slot of this session holds {max_items} rows: raise it "
               f"with {setting} (or the broker's [sessions] default_max_items or default_ring_mib), or send the "
               f"request with infer(), submit() or call(), which split it into parts")
    else:
        why = "a request has at least one row"
    raise BadInput(f"{field}: expected 1..{min(plan.info.max_batch, max_items)} rows ({why}), got {rows}",
                   "BAD_SHAPE")


def checked_arrays(plan: ModelPlan, inputs: object, max_items: int,
                   setting: str = MAX_ITEMS_SETTING) -> list[np.ndarray]:
    """The inputs (an array, or a dict of them by input name) as arrays in model order, each checked against the
    model; BadInput names the first fault's field (``inputs`` or ``inputs['x']``) and what it expects."""
    specs = plan.info.inputs
    if not isinstance(inputs, Mapping):
        if len(specs) != 1:
            expected = ", ".join(f"{s.name!r}: {_expected(plan, k)}" for k, s in enumerate(specs))
            raise BadInput(f"inputs: model {plan.info.name!r} takes several inputs: expected a dict {{{expected}}}, "
                           f"got {_kind(inputs)}")
        # Client unwraps {name: value} of a one-input model before calling here, so the value may have come in
        # a dict: the message names both forms
        inputs = {specs[0].name: _array(inputs, plan, 0, f"inputs (or inputs[{specs[0].name!r}])")}
    extra = set(inputs) - {s.name for s in specs}
    if extra:
        raise BadInput(f"inputs {sorted(extra, key=repr)}: model {plan.info.name!r} has no such input; "
                       f"its inputs are {[s.name for s in specs]}")
    out: list[np.ndarray] = []
    for k, spec in enumerate(specs):
        if spec.name not in inputs:
            raise BadInput(f"inputs[{spec.name!r}] is missing: expected {_expected(plan, k)}")
        arr = _array(inputs[spec.name], plan, k, f"inputs[{spec.name!r}]")
        if arr.dtype != plan.in_dtypes[k]:
            raise BadInput(f"inputs[{spec.name!r}].dtype: expected {spec.dtype}, got {arr.dtype}", "BAD_DTYPE")
        if arr.ndim != len(spec.shape) or arr.shape[1:] != plan.in_item_shapes[k]:
            raise BadInput(f"inputs[{spec.name!r}].shape: expected {_shape(plan, k)}, got {list(arr.shape)}",
                           "BAD_SHAPE")
        if out and arr.shape[0] != out[0].shape[0]:
            raise BadInput(f"inputs[{spec.name!r}].shape[0]: {arr.shape[0]} rows, first input has "
                           f"{out[0].shape[0]}", "BAD_SHAPE")
        check_rows(plan, arr.shape[0], f"inputs[{spec.name!r}].shape[0]", max_items, setting)
        out.append(arr)
    return out


IMAGE_TYPES = (bytes, bytearray, memoryview)


def image_rows(plan: ModelPlan, inputs: object) -> list[ImageRow]:
    """The encoded images of a request to a model of images (a bytes-like object, or a list, tuple or 1-D object
    array of them; or that in a dict under the input's name) as a list of bytes-likes, one a row, each checked
    against the model's ``max_image_bytes``; BadInput names the row. Nothing is decoded here."""
    if type(inputs) is bytes and 0 < len(inputs) <= plan.image_max_bytes:
        return [inputs]  # one photo's file bytes, the common case: none of the checks below can fail
    name = plan.info.inputs[0].name
    if isinstance(inputs, Mapping):
        if set(inputs) != {name}:
            raise BadInput(f"inputs: model {plan.info.name!r} takes one input, {name!r}: expected the images, or "
                           f"{{{name!r}: images}}, got keys {sorted(inputs, key=repr)}")
        inputs = inputs[name]
    if isinstance(inputs, IMAGE_TYPES):
        rows: list[object] = [inputs]
    elif isinstance(inputs, list | tuple) or (isinstance(inputs, np.ndarray) and inputs.dtype == object
                                               and inputs.ndim == 1):
        rows = list(inputs)
    else:
        raise BadInput(f"inputs: model {plan.info.name!r} takes encoded images (JPEG or PNG): expected bytes, or a "
                       f"list of bytes, one image each (the file's bytes as they are), got {_kind(inputs)}")
    check_rows(plan, len(rows), "inputs (images)", plan.info.max_batch)
    limit = plan.image_max_bytes
    out: list[ImageRow] = []
    for k, row in enumerate(rows):
        if not isinstance(row, IMAGE_TYPES):
            raise BadInput(f"inputs[{k}]: expected the bytes of an encoded image, got {_kind(row)}")
        n = len(row) if type(row) is bytes else memoryview(row).nbytes
        if not 1 <= n <= limit:
            raise BadInput(f"inputs[{k}]: an image of {n} bytes; model {plan.info.name!r} takes 1..{limit} bytes a "
                           f"row (the broker's models.{plan.info.name}.max_image_bytes)", "BAD_SIZE")
        out.append(memoryview(row).cast("B") if isinstance(row, memoryview) else row)
    return out


def _array(value: object, plan: ModelPlan, k: int, field: str) -> np.ndarray:
    """``value`` as an array, or BadInput naming ``field``.

    Lists, tuples, scalars, str and None are refused rather than converted: NumPy would guess their dtype
    (float64 for Python floats, int64 for ints), so a list would either fail later with a dtype message that
    does not say why, or, for a model taking float64 or int64, be accepted by a guess the caller never made.
    An array-like with a dtype of its own (``__array__``, as a CPU torch tensor has) is converted: its dtype is
    the caller's, and is checked as an array's would be.
    """
    if isinstance(value, np.ndarray):
        return value
    if hasattr(value, "__array__") or hasattr(value, "__array_interface__"):
        try:
            return np.asarray(value)
        except (TypeError, ValueError, RuntimeError) as exc:  # e.g. a GPU tensor refuses implicit conversion
            raise BadInput(f"{field}: expected {_expected(plan, k)}; converting {_kind(value)} failed: {exc}") \
                from None
    hint = ""
    if isinstance(value, list | tuple | int | float | complex):
        hint = (f" ({_kind(value)} data is not converted: build the array with its dtype, "
                f"np.asarray(data, np.{plan.in_dtypes[k].name}))")
    raise BadInput(f"{field}: expected {_expected(plan, k)}, got {_kind(value)}{hint}")


def _shape(plan: ModelPlan, k: int) -> str:
    return f"[{', '.join(['N', *map(str, plan.in_item_shapes[k])])}]"


def _expected(plan: ModelPlan, k: int) -> str:
    return f"a numpy array of dtype {plan.in_dtypes[k].name} and shape {_shape(plan, k)}"


def _kind(value: object) -> str:
    return "None" if value is None else type(value).__name__
