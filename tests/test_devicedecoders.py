"""gpu_worker/devicedecoders.py's parts that need no device: the retry of the rows the hardware decoder refused
(the decoders themselves: tests/gpu/test_device_photos.py)."""

from __future__ import annotations

from typing import Any

from shmbroker.gpu_worker.devicedecoders import retry_refused


def test_only_the_refused_rows_are_decoded_again_in_one_call_and_in_order() -> None:
    calls: list[list[Any]] = []

    def again(codes: list[Any]) -> list[Any]:
        calls.append(codes)
        return [f"cuda:{c}" for c in codes]

    out = retry_refused(["hw:a", None, "hw:c", None], ["a", "b", "c", "d"], again)
    assert out == ["hw:a", "cuda:b", "hw:c", "cuda:d"]
    assert calls == [["b", "d"]]


def test_a_row_both_refuse_stays_refused() -> None:
    out = retry_refused([None, "hw:b"], ["a", "b"], lambda codes: [None] * len(codes))
    assert out == [None, "hw:b"]


def test_nothing_refused_makes_no_second_call() -> None:
    def fail(codes: list[Any]) -> list[Any]:
        raise AssertionError(f"called with {codes}")

    images = ["hw:a", "hw:b"]
    assert retry_refused(images, ["a", "b"], fail) == images
