"""client.links: the least-outstanding live worker that serves the model gets the request, ties go round robin;
queued SUBMITs leave together as one message per worker, carrying the session's id and token."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from shmbroker.broker.common import protocol as P
from shmbroker.client.links import Links
from shmbroker.client.session import ModelPlan

TINY = ModelPlan.of(P.ModelInfo(0, "tiny", 16, [P.TensorSpec("x", "float32", [-1, 256])],
                                [P.TensorSpec("y", "float32", [-1, 256])], 2000))


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    c: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield c
    c.destroy(linger=0)


def _workers(tmp: Path, models: list[list[str]]) -> list[P.WorkerInfo]:
    return [P.WorkerInfo(k, "cpu", f"ipc://{tmp}/w{k}", f"ipc://{tmp}/r{k}", m) for k, m in enumerate(models)]


def test_the_least_outstanding_live_worker_serving_the_model_is_chosen(
        tmp_path: Path, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    links = Links(ctx)
    links.replace(_workers(tmp_path, [["tiny"], ["tiny"], ["other"], ["tiny"]]), 7, 99)
    w0, w1, w2, w3 = links.current
    for link in (w0, w1, w2):
        link.up = True  # w3's reply connection is not up: it gets nothing
    w0.outstanding, w1.outstanding, w2.outstanding, w3.outstanding = 3, 1, 0, 0
    assert [links.choose(TINY) for _ in range(4)] == [w1] * 4
    w1.outstanding = 3
    assert {links.choose(TINY) for _ in range(4)} == {w0, w1}  # a tie: both get turns
    links.close_all()


def test_no_live_worker_for_the_model_is_none(tmp_path: Path, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    links = Links(ctx)
    links.replace(_workers(tmp_path, [["other"]]), 7, 99)
    links.current[0].up = True
    assert links.choose(TINY) is None
    links.close_all()


def test_queued_records_leave_as_one_submit_per_worker(tmp_path: Path, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    pull = ctx.socket(zmq.PULL)
    pull.bind(f"ipc://{tmp_path}/w0")
    links = Links(ctx)
    links.replace(_workers(tmp_path, [["tiny"]]), 7, 99)
    link = links.current[0]
    link.up = True
    desc = TINY.layout(1).in_desc_bytes
    with links.cork:
        links.send(link, (1, 0, 1, 0, 1, 0, desc), defer=False)
        links.send(link, (2, 1, 1, 0, 1, 0, desc), defer=True)
    assert pull.poll(100) == 0  # corked: nothing left yet
    links.flush_all()
    assert pull.poll(10_000)
    frames = pull.recv_multipart()
    assert P.read_envelope(frames) == P.MsgKind.SUBMIT
    submit = P.decode_submit(frames[1])
    assert (submit.session_id, submit.token) == (7, 99)
    assert [(r.request_id, r.slot) for r in submit.requests] == [(1, 0), (2, 1)]
    assert [t.shape for r in submit.requests for t in r.tensors] == [(1, 256), (1, 256)]
    assert pull.poll(100) == 0
    links.close_all()
