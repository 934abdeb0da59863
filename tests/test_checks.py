"""client.checks: a timeout must fit the wire's u32 microseconds; None means the model's default. Inputs that
are not arrays (a list, str, None) are BadInput naming the field and what it expects, also through a live Client."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from shmbroker.broker.common import protocol as P
from shmbroker.client import BadInput, Client
from shmbroker.client.checks import MAX_TIMEOUT_S, check_timeout, checked_arrays
from shmbroker.client.session import ModelPlan
from tests.conftest import RunningBroker


@pytest.mark.parametrize("timeout", [None, 1e-6, 1.0, MAX_TIMEOUT_S])
def test_accepted_timeouts(timeout: float | None) -> None:
    check_timeout(timeout)


@pytest.mark.parametrize("timeout", [0, -1.0, MAX_TIMEOUT_S * 1.001, float("nan")])
def test_rejected_timeouts(timeout: float) -> None:
    with pytest.raises(BadInput, match="timeout: expected 0 < timeout"):
        check_timeout(timeout)


TINY = ModelPlan.of(P.ModelInfo(0, "tiny", 16, [P.TensorSpec("x", "float32", [-1, 256])],
                                [P.TensorSpec("y", "float32", [-1, 256])], 2000))
PAIR = ModelPlan.of(P.ModelInfo(1, "pair", 16, [P.TensorSpec("a", "float32", [-1, 4]),
                                                P.TensorSpec("b", "int64", [-1])],
                                [P.TensorSpec("y", "float32", [-1, 4])], 2000))
A = np.zeros((1, 4), np.float32)


ONE = r"^BAD_INPUT: inputs \(or inputs\['x'\]\): expected a numpy array of dtype float32 and shape \[N, 256\], got "


@pytest.mark.parametrize(("plan", "inputs", "message"), [
    (TINY, [1.0] * 256, ONE + r"list \(list data is not converted: .*np.asarray\(data, np.float32\)\)$"),
    (TINY, [[1.0] * 256], ONE + "list"),
    (TINY, "x", ONE + "str$"),
    (TINY, None, ONE + "None$"),
    (TINY, 1.0, ONE + r"float \(float data is not converted"),
    (PAIR, [A, [1]], r"^BAD_INPUT: inputs: model 'pair' takes several inputs: expected a dict \{'a': a numpy array "
                     r"of dtype float32 and shape \[N, 4\], 'b': a numpy array of dtype int64 and shape \[N\]\}, "
                     r"got list$"),
    (PAIR, {"a": A, "b": [1]}, r"^BAD_INPUT: inputs\['b'\]: expected a numpy array of dtype int64 and shape \[N\], "
                               r"got list"),
    (PAIR, {"a": A, "b": None}, r"^BAD_INPUT: inputs\['b'\]: expected .*got None$"),
    (PAIR, {"a": A}, r"^BAD_INPUT: inputs\['b'\] is missing: expected a numpy array of dtype int64"),
    (PAIR, {"a": A, "b": np.zeros(1, np.int64), 3: A}, r"^BAD_INPUT: inputs \[3\]: model 'pair' has no such input"),
])
def test_non_arrays_are_bad_input_naming_the_field_and_what_it_expects(plan: ModelPlan, inputs: object,
                                                                       message: str) -> None:
    with pytest.raises(BadInput, match=message) as exc:
        checked_arrays(plan, inputs, 16)
    assert exc.value.code == "BAD_INPUT"


def test_array_likes_with_their_own_dtype_are_converted_and_still_checked() -> None:
    class Tensor:  # what a CPU tensor of another library offers NumPy
        def __init__(self, a: np.ndarray) -> None:
            self.a = a

        def __array__(self, dtype: object = None, copy: object = None) -> np.ndarray:
            return self.a

    x = np.ones((2, 256), np.float32)
    [got] = checked_arrays(TINY, Tensor(x), 16)
    assert got is x
    with pytest.raises(BadInput, match=r"inputs\['x'\].dtype: expected float32, got float64") as exc:
        checked_arrays(TINY, Tensor(x.astype(np.float64)), 16)
    assert exc.value.code == "BAD_DTYPE"


def test_client_entry_points_refuse_non_arrays_before_sending(process_broker: RunningBroker) -> None:
    """infer, submit and call raise the BadInput at the call (nothing is sent); the session serves on."""
    with Client(slots=1) as c:
        wrong: list[Any] = [[1.0] * 256, "x", None, {"x": [1.0] * 256}, np.ones((1, 256)).tolist()]
        for inputs in wrong:
            calls: list[Callable[[], object]] = [
                lambda: c.infer("tiny", inputs), lambda: c.submit("tiny", inputs),  # noqa: B023
                lambda: c.call("tiny", inputs, lambda out, err: None)]  # noqa: B023
            for call in calls:
                with pytest.raises(BadInput, match=ONE):
                    call()
        y = c.infer("tiny", np.ones((1, 256), np.float32))  # the one slot was not taken by a refused call
        assert isinstance(y, np.ndarray) and y.shape == (1, 256)
    answered = [m.requests for w in process_broker.stats().workers for m in w.models if m.name == "tiny"]
    assert answered == [{"OK": 1}]  # only the good request reached the worker
