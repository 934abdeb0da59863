"""The zero-copy ``with c.request(model, rows) as req:`` API as a user sees it, against a live broker: outputs are
read-only views valid inside the block; after it, the request refuses further use and the arrays it handed out
cannot write into a slot that serves other requests (they still read it: the docstring says to copy). A
submitted request's Future holds copies that outlive the block, and its slot is freed once answered; on an
event loop (AsyncClient.request) the same, the loop never blocking on a slot."""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Iterator

import numpy as np
import pytest

from shmbroker.client import AsyncClient, Client, RequestTimeout, ShmBrokerError
from tests.conftest import RunningBroker, arr, running_broker


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningBroker]:
    with running_broker(tmp_path_factory.mktemp("request")) as b:
        yield b


def tiny_ref(c: Client, x: np.ndarray) -> np.ndarray:
    """tiny's answer through the copying API, to compare the zero-copy one with."""
    return arr(c.infer("tiny", x)).copy()


def test_outputs_are_read_only_views_of_the_slot_inside_the_block(live: RunningBroker) -> None:
    x = np.random.default_rng(3).standard_normal((2, 256), dtype=np.float32)
    with Client(live.runtime_dir) as c:
        want = tiny_ref(c, x)
        with c.request("tiny", rows=2) as req:
            req.inputs["x"][...] = x  # inputs are writable inside the block
            y = arr(req.run())
            assert not y.flags.owndata and not y.flags.writeable
            np.testing.assert_allclose(y, want, rtol=0, atol=1e-5)
            with pytest.raises(ValueError, match="read-only"):
                y[0, 0] = 1.0
            with pytest.raises(ValueError, match="read-only"):
                y[:1] += 1.0  # a slice of a read-only view is read-only too
            np.testing.assert_allclose(arr(req.run()), want, rtol=0, atol=1e-5)  # run() again: same slot, same


def test_after_the_block_the_request_refuses_use_and_kept_arrays_cannot_write(live: RunningBroker) -> None:
    ones, zeros = np.ones((1, 256), np.float32), np.zeros((1, 256), np.float32)
    with Client(live.runtime_dir, slots=1) as c:  # one slot: the next request reuses the block's slot
        want_ones, want_zeros = tiny_ref(c, ones), tiny_ref(c, zeros)
        assert not np.array_equal(want_ones, want_zeros)
        with c.request("tiny") as req:
            kept_in = req.inputs["x"]
            kept_in[...] = ones
            kept_out = arr(req.run())
            copied = kept_out.copy()  # what the docstring tells a user to do with a result kept past the block
        with pytest.raises(ShmBrokerError, match="block has ended") as exc:
            req.run()
        assert exc.value.code == "REQUEST_ENDED"
        with pytest.raises(ShmBrokerError, match=r"req.inputs\['x'\].*block has ended"):
            req.inputs["x"]
        assert req.outputs == {}
        with pytest.raises(ValueError, match="read-only"):
            kept_in[...] = 7.0  # would have overwritten the input of whatever request holds the slot now
        with pytest.raises(ValueError, match="read-only"):
            kept_out[...] = 7.0
        np.testing.assert_allclose(arr(c.infer("tiny", zeros)), want_zeros, rtol=0, atol=1e-5)
        # documented, not preventable: a view kept past the block reads the slot, now the last request's result
        np.testing.assert_allclose(kept_out, want_zeros, rtol=0, atol=1e-5)
        np.testing.assert_allclose(copied, want_ones, rtol=0, atol=1e-5)


def test_submit_sends_the_filled_slot_and_its_future_outlives_the_block(live: RunningBroker) -> None:
    ones, zeros = np.ones((1, 256), np.float32), np.zeros((1, 256), np.float32)
    with Client(live.runtime_dir, slots=1) as c:  # one slot: only an answered request frees it for the next
        want_ones, want_zeros = tiny_ref(c, ones), tiny_ref(c, zeros)
        with c.request("tiny") as req:
            req.inputs["x"][...] = ones
            fut = req.submit()
            with pytest.raises(ValueError, match="read-only"):
                req.inputs["x"][...] = zeros  # the worker reads the inputs once they are sent
            for again in (req.submit, req.run):
                with pytest.raises(ShmBrokerError, match="submitted") as exc:
                    again()
                assert exc.value.code == "REQUEST_SENT"
        y = arr(fut.result(10))
        assert y.flags.owndata, "a submitted request's outputs are copies: they outlive the block"
        np.testing.assert_allclose(y, want_ones, rtol=0, atol=1e-5)
        # the slot was freed by the answer: the next request takes it, and the first result stays as it was
        np.testing.assert_allclose(arr(c.infer("tiny", zeros)), want_zeros, rtol=0, atol=1e-5)
        np.testing.assert_allclose(y, want_ones, rtol=0, atol=1e-5)


def test_many_submitted_requests_each_get_their_own_result_awaited_in_asyncio(live: RunningBroker) -> None:
    xs = np.random.default_rng(5).standard_normal((24, 1, 256), dtype=np.float32)
    with Client(live.runtime_dir, slots=8) as c:
        wants = [tiny_ref(c, x) for x in xs]

        async def run_all() -> list[np.ndarray]:
            pending = []
            for x in xs:
                with c.request("tiny") as req:  # once 8 are in flight, waits for a slot that an answer frees
                    np.copyto(req.inputs["x"], x)
                    pending.append(asyncio.wrap_future(req.submit()))
                if len(pending) % 8 == 0:
                    await asyncio.sleep(0)  # the answers arrive while the loop goes on
            return [arr(y) for y in await asyncio.gather(*pending)]

        for got, want in zip(asyncio.run(run_all()), wants, strict=True):
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


def test_a_run_that_gave_up_waiting_frees_its_slot_once_the_answer_comes(live: RunningBroker) -> None:
    x = np.ones((1, 256), np.float32)
    with Client(live.runtime_dir, slots=1) as c:  # one slot: a slot held for good would stop the client
        want = tiny_ref(c, x)
        # nothing is answered until the block has ended
        with live.workers_stopped(), c.request("tiny", timeout=0.05) as req:
            req.inputs["x"][...] = x
            with pytest.raises(RequestTimeout):
                req.run()  # gives up at the deadline and the grace; the slot stays held meanwhile
        # the worker, resumed, answers the late request (TIMEOUT), and that answer frees the slot
        np.testing.assert_allclose(arr(c.infer("tiny", x, timeout=10)), want, rtol=0, atol=1e-5)


def test_async_zero_copy_requests_share_the_slots_without_blocking_the_loop(live: RunningBroker) -> None:
    xs = np.random.default_rng(9).standard_normal((6, 1, 256), dtype=np.float32)

    async def scenario(wants: list[np.ndarray]) -> None:
        async with AsyncClient(live.runtime_dir, slots=2) as ac:
            pending = []
            for x in xs:  # 6 requests through 2 slots: the third block waits for a permit an answer gives back
                async with ac.request("tiny") as req:
                    np.copyto(req.inputs["x"], x)
                    pending.append(req.submit())
                    with pytest.raises(ShmBrokerError, match="submitted"):
                        req.submit()
            for got, want in zip(await asyncio.gather(*pending), wants, strict=True):
                np.testing.assert_allclose(arr(got), want, rtol=0, atol=1e-5)
            async with ac.request("tiny"):
                pass  # nothing submitted: the block's end gives the slot back
            with live.workers_stopped():
                held = []
                for x in xs[:2]:
                    async with ac.request("tiny") as req:
                        np.copyto(req.inputs["x"], x)
                        held.append(req.submit())
                ticks = 0

                async def tick() -> None:
                    nonlocal ticks
                    while True:
                        ticks += 1
                        await asyncio.sleep(0)

                ticker = asyncio.create_task(tick())
                with pytest.raises(RequestTimeout, match=r"no free slot within 0\.2 s"):
                    async with ac.request("tiny", timeout=0.2):
                        pass  # both slots are out: the wait for one ends
                ticker.cancel()
                assert ticks > 1, "the event loop was blocked while the request waited for a slot"
            for got, want in zip(await asyncio.gather(*held), wants[:2], strict=True):
                np.testing.assert_allclose(arr(got), want, rtol=0, atol=1e-5)

    with Client(live.runtime_dir) as c:
        wants = [tiny_ref(c, x) for x in xs]
    asyncio.run(scenario(wants))


def test_call_sends_the_filled_slot_and_the_callback_gets_a_copy(live: RunningBroker) -> None:
    xs = np.random.default_rng(11).standard_normal((5, 1, 256), dtype=np.float32)
    got: dict[int, np.ndarray] = {}
    errors: list[ShmBrokerError] = []
    all_in = threading.Event()

    def done(i: int, out: object, err: ShmBrokerError | None) -> None:
        if err is not None:
            errors.append(err)
        else:
            got[i] = arr(out)
        if len(got) + len(errors) == len(xs):
            all_in.set()

    with Client(live.runtime_dir, slots=2) as c:
        wants = [tiny_ref(c, x) for x in xs]
        for i, x in enumerate(xs):  # 5 requests through 2 slots: each answer frees its slot for the next
            with c.request("tiny") as req:
                np.copyto(req.inputs["x"], x)
                req.call(functools.partial(done, i))
                with pytest.raises(ShmBrokerError, match="submitted"):
                    req.run()
        assert all_in.wait(30) and not errors, errors
    for i, want in enumerate(wants):
        assert got[i].flags.owndata, "the callback's outputs are a copy: the slot serves other requests"
        np.testing.assert_allclose(got[i], want, rtol=0, atol=1e-5)
