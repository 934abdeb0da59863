"""shmbroker.ray on a Ray cluster of two nodes on this machine (Ray's own test cluster), each node with its own
broker and runtime directory, found by the node's replica through the $SHMBROKER_RUNTIME_DIR that the node's
raylet hands its workers. Real brokers, real Ray Serve replicas, Ray's HTTP proxy on a loopback port.

What a caller sees is checked: the answers of the direct client, both nodes serving, the client's typed errors
(not Ray's), and a node whose broker is killed under load: every request answered once, none hanging, the other
node serving within 5 s, the node serving again once its broker is back.
"""

from __future__ import annotations

import asyncio
import collections
import http.client
import io
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

if not os.environ.get("CI"):  # CI installs the [ray] extra (.ci/run): there a missing Ray fails, never skips
    pytest.importorskip("ray.serve", reason="needs the [ray] extra: pip install -e '.[ray]'")

import ray
import tritonclient.http as th
from ray import serve
from ray.cluster_utils import Cluster
from ray.exceptions import ActorDiedError

from shmbroker.client import AsyncClient, BadInput, Overloaded, RequestTimeout, UnknownModel, WorkerDied
from shmbroker.ray import NODE_HEADER, NODE_RESOURCE, BrokerHandle, build_app, node_broker
from shmbroker.ray.handle import typed
from tests.conftest import PHOTO_MODEL, RunningBroker, arr, free_port, start_broker, wait_until
from tests.models import direct

# tiny, and "held": a queue that keeps its lone request 5 s (Triton's rule, waiting for 16 rows), one place
# long. A deadline shorter than that is the broker's TIMEOUT; a request that finds the place taken, OVERLOADED.
# No health probes: one would wait in held's queue past its timeout, and the broker would call held unready.
MODELS = """
[monitoring]
probe_interval_ms = 0

[models.tiny]
path = "builtin:tiny"
max_batch = 16
max_queue_delay_us = 1000
max_queue_size = 256
timeout_ms = 10000
intra_op_threads = 1

[models.held]
path = "builtin:tiny"
batching = "triton"
max_batch = 16
max_queue_delay_us = 5000000
max_queue_size = 1
timeout_ms = 20000
intra_op_threads = 1
""" + PHOTO_MODEL
SESSIONS = "default_slots = 8\ndefault_max_items = 4"
HELD_S = 5.0
IN_FLIGHT = 32
FAILOVER_BOUND_S = 5.0  # the bound: the surviving node serves within this of the other's broker kill


@dataclass
class Node:
    tmp: Path
    broker: RunningBroker

    def ok(self, model: str = "") -> int:
        """Requests (of ``model``, or any) this node's broker answered OK since it started."""
        return sum(m.requests.get("OK", 0) for w in self.broker.stats().workers for m in w.models
                   if m.name == model or not model)

    def restart(self) -> None:
        self.broker = start_broker(self.tmp, "process", models=MODELS, sessions=SESSIONS)


@dataclass
class RayCluster:
    nodes: list[Node]
    handle: Any
    port: int
    node_ids: list[str] = field(default_factory=list)

    def http(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)

    def triton(self) -> th.InferenceServerClient:
        return th.InferenceServerClient(f"127.0.0.1:{self.port}", network_timeout=60, connection_timeout=60)


def _serve_running() -> bool:
    app = serve.status().applications.get("shmbroker")
    return app is not None and app.status == "RUNNING"


@pytest.fixture(scope="module")
def rc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayCluster]:
    """Two brokers, a two-node Ray cluster (one CPU each: Serve's controller and proxy take none), and the
    deployment of two replicas, one a node; all stopped at the end, no ring left held."""
    usage_stats = os.environ.get("RAY_USAGE_STATS_ENABLED")
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"  # no report leaves the machine
    nodes: list[Node] = []
    cluster = None
    try:
        for name in ("a", "b"):
            tmp = tmp_path_factory.mktemp(f"ray-node-{name}")
            nodes.append(Node(tmp, start_broker(tmp, "process", models=MODELS, sessions=SESSIONS)))
        common = {"num_cpus": 1, "resources": {NODE_RESOURCE: 1}, "object_store_memory": 100 << 20}
        env = [{"SHMBROKER_RUNTIME_DIR": str(n.broker.runtime_dir)} for n in nodes]  # each node's broker
        head = {**common, "include_dashboard": False, "env_vars": env[0]}
        cluster = Cluster(initialize_head=True, head_node_args=head)
        cluster.add_node(**common, env_vars=env[1])
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
        handle = serve.run(build_app({"nodes": 2, "slots": 16, "max_items": 2}), name="shmbroker", route_prefix="/")
        yield RayCluster(nodes, handle, port, [n["NodeID"] for n in ray.nodes() if n["Alive"]])
    finally:
        if ray.is_initialized():
            serve.shutdown()
            ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
        if usage_stats is None:
            os.environ.pop("RAY_USAGE_STATS_ENABLED", None)
        else:
            os.environ["RAY_USAGE_STATS_ENABLED"] = usage_stats
        for n in nodes:
            assert n.broker.stop_released() == 0, n.broker.log()


def run(coro: Any) -> Any:
    """Run a coroutine on a fresh event loop (each test's own: a BrokerHandle belongs to one loop)."""
    return asyncio.run(coro)


def tiny_inputs(n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.random((1, 256), dtype=np.float32) for _ in range(n)]


def jpeg(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    img = Image.fromarray((rng.random((48, 64, 3)) * 255).astype(np.uint8))
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=90)
    return buf.getvalue()


# -- answers ---------------------------------------------------------------------------------------------------------


def test_answers_through_the_handle_are_the_direct_clients(rc: RayCluster) -> None:
    """One request at a time (batches of one on both paths): BrokerHandle, a plain DeploymentHandle call and the
    direct AsyncClient give the same bytes, for tensors and for photos."""
    xs = tiny_inputs(6, seed=1)
    photos = [jpeg(s) for s in range(2)]

    async def answers() -> tuple[list[Any], list[Any], list[Any]]:
        bh = BrokerHandle(rc.handle)
        via_bh = [await bh.infer("tiny", x, timeout=30) for x in xs] + [await bh.infer("nsfw_photo", p) for p in photos]
        via_handle = [await rc.handle.infer.remote("tiny", x) for x in xs]
        async with AsyncClient(rc.nodes[0].broker.runtime_dir) as ac:
            mine = [await ac.infer("tiny", x) for x in xs] + [await ac.infer("nsfw_photo", p) for p in photos]
        return via_bh, via_handle, mine

    via_bh, via_handle, mine = run(answers())
    for got in (via_bh, via_handle):
        for y, want in zip(got, mine, strict=False):
            assert isinstance(y, np.ndarray) and y.dtype == want.dtype
            np.testing.assert_array_equal(y, want)
    for x, y in zip(xs, mine, strict=False):
        np.testing.assert_allclose(y, direct("tiny", x), rtol=0, atol=1e-5)
    assert mine[-1].shape == (1, 2) and 0.0 <= float(mine[-1][0, 1]) <= 1.0


def _direct(rc: RayCluster, model: str, xs: list[Any]) -> list[np.ndarray]:
    """The direct client's answers (node a's broker), one request at a time."""

    async def answers() -> list[np.ndarray]:
        async with AsyncClient(rc.nodes[0].broker.runtime_dir) as ac:
            return [arr(await ac.infer(model, x)) for x in xs]

    out: list[np.ndarray] = run(answers())
    return out


def _post(conn: http.client.HTTPConnection, path: str, body: bytes,
          headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    conn.request("POST", path, body=body, headers=headers or {"Content-Type": "application/json"})
    r = conn.getresponse()
    return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()


def _get(conn: http.client.HTTPConnection, path: str) -> tuple[int, dict[str, str], bytes]:
    conn.request("GET", path)
    r = conn.getresponse()
    return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()


def test_answers_over_the_http_proxy_are_the_direct_clients(rc: RayCluster) -> None:
    """KServe v2 through Ray's HTTP proxy: JSON and binary bodies, by hand and with the official client, answer as
    the direct client does; metadata and readiness as `shmbroker http` gives them; each answer names its node."""
    xs = tiny_inputs(3, seed=2)
    want = _direct(rc, "tiny", xs)
    conn = rc.http()
    try:
        status, headers, body = _get(conn, "/v2/models/tiny")
        assert status == 200, body
        assert json.loads(body)["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 256]}]
        assert headers[NODE_HEADER.lower()] in rc.node_ids
        for path in ("/v2/health/live", "/v2/health/ready", "/v2/models/tiny/ready",
                     "/v2/models/tiny/versions/1/ready"):
            status, _, body = _get(conn, path)
            assert status == 200, (path, body)
        for x, y in zip(xs, want, strict=True):
            doc = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 256], "data": x.ravel().tolist()}]}
            status, headers, body = _post(conn, "/v2/models/tiny/infer", json.dumps(doc).encode())
            assert status == 200 and headers["content-type"] == "application/json", body
            (out,) = json.loads(body)["outputs"]
            assert out["name"] == "y" and out["shape"] == [1, 256]
            np.testing.assert_array_equal(np.asarray(out["data"], np.float32).reshape(1, 256), y)
            header = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 256],
                                             "parameters": {"binary_data_size": x.nbytes}}],
                                 "parameters": {"binary_data_output": True}}).encode()
            status, headers, body = _post(conn, "/v2/models/tiny/infer", header + x.tobytes(),
                                          {"Inference-Header-Content-Length": str(len(header)),
                                           "Content-Type": "application/octet-stream"})
            assert status == 200, body
            start = int(headers["inference-header-content-length"])
            np.testing.assert_array_equal(np.frombuffer(body[start:], np.float32).reshape(1, 256), y)
    finally:
        conn.close()
    client = rc.triton()
    try:
        for binary in (False, True):
            for x, y in zip(xs, want, strict=True):
                inp = th.InferInput("x", [1, 256], "FP32")
                inp.set_data_from_numpy(x, binary_data=binary)
                out = client.infer("tiny", [inp], outputs=[th.InferRequestedOutput("y", binary_data=binary)])
                np.testing.assert_array_equal(out.as_numpy("y"), y)
    finally:
        client.close()


def test_photos_over_the_http_proxy_are_the_direct_clients(rc: RayCluster) -> None:
    """A photo POSTed as the body, and photos as a KServe v2 BYTES input, answer as the direct client does."""
    photos = [jpeg(s) for s in range(2)]
    want = _direct(rc, "nsfw_photo", photos)
    conn = rc.http()
    try:
        for photo, y in zip(photos, want, strict=True):
            status, _, body = _post(conn, "/v2/models/nsfw_photo/infer", photo, {"Content-Type": "image/jpeg"})
            assert status == 200, body
            (out,) = json.loads(body)["outputs"]
            np.testing.assert_array_equal(np.asarray(out["data"], np.float32).reshape(y.shape), y)
        status, _, body = _post(conn, "/v2/models/nsfw_photo/infer", b"not a photo", {"Content-Type": "image/jpeg"})
        assert status == 400 and b"not a JPEG or PNG" in body, body
    finally:
        conn.close()
    client = rc.triton()
    try:
        inp = th.InferInput("image", [len(photos)], "BYTES")
        inp.set_data_from_numpy(np.array(photos, dtype=np.object_), binary_data=True)
        out = client.infer("nsfw_photo", [inp])
        name = out.get_response()["outputs"][0]["name"]
        np.testing.assert_array_equal(out.as_numpy(name), np.concatenate(want))
    finally:
        client.close()


def test_both_nodes_serve_under_load(rc: RayCluster) -> None:
    """32 requests in flight through one BrokerHandle: every answer right, and each node's broker serves a fair
    share (Ray routes each call to the less loaded of two replicas)."""
    total = 1600
    xs = tiny_inputs(64, seed=3)
    refs = [direct("tiny", x) for x in xs]
    before = [n.ok() for n in rc.nodes]

    async def load() -> list[tuple[int, np.ndarray]]:
        bh = BrokerHandle(rc.handle)
        outs: list[tuple[int, np.ndarray]] = []

        async def chain(first: int) -> None:
            for i in range(first, total, IN_FLIGHT):
                outs.append((i, arr(await bh.infer("tiny", xs[i % len(xs)], timeout=60))))

        await asyncio.gather(*(chain(k) for k in range(IN_FLIGHT)))
        return outs

    outs = run(load())
    assert len(outs) == total
    for i, y in outs:
        np.testing.assert_allclose(y, refs[i % len(xs)], rtol=0, atol=1e-5)
    gained = [n.ok() - b for n, b in zip(rc.nodes, before, strict=True)]
    assert sum(gained) >= total and min(gained) >= total // 10, f"OK answers per node's broker: {gained}"


# -- typed errors ----------------------------------------------------------------------------------------------------


def _held_queues_empty(rc: RayCluster) -> None:
    def empty() -> bool:
        return all(m.queue_depth == 0 for node in rc.nodes for w in node.broker.stats().workers for m in w.models
                   if m.name == "held")

    wait_until(empty, "held's queue empty on both nodes")


def test_deadline_shorter_than_the_queue_is_the_typed_timeout(rc: RayCluster) -> None:
    """"held" keeps a lone request 5 s: a 1 s deadline comes back as RequestTimeout (BrokerHandle, a plain
    handle call) and 504 over HTTP, the broker's TIMEOUT, not Ray's error. Without a deadline the same request
    is answered once the queue lets it go."""
    x = tiny_inputs(1, seed=4)[0]

    async def failing(make: Callable[[], Any]) -> BaseException | None:
        try:
            await make()  # made in the loop that awaits it
        except Exception as exc:
            return exc
        return None

    bh = BrokerHandle(rc.handle)
    for make in (lambda: bh.infer("held", x, timeout=1.0), lambda: rc.handle.infer.remote("held", x, timeout=1.0)):
        # the last call's request may still hold its node's one queue place for a moment after its caller heard
        # TIMEOUT (the worker sweeps expired requests every 2 ms): the next one would find it taken (OVERLOADED)
        _held_queues_empty(rc)
        e = run(failing(make))
        assert isinstance(e, RequestTimeout) and e.code == "TIMEOUT", repr(e)
    _held_queues_empty(rc)
    patient = run(bh.infer("held", x))  # the model's own 20 s timeout: the 5 s queue lets it go
    np.testing.assert_allclose(patient, direct("tiny", x), rtol=0, atol=1e-5)
    _held_queues_empty(rc)
    conn = rc.http()
    try:
        doc = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 256], "data": x.ravel().tolist()}],
               "parameters": {"timeout": 1_000_000}}
        status, headers, body = _post(conn, "/v2/models/held/infer", json.dumps(doc).encode())
        assert status == 504 and json.loads(body)["error"].startswith("TIMEOUT: "), (status, body)
        assert headers[NODE_HEADER.lower()] in rc.node_ids
    finally:
        conn.close()


def test_overloaded_unknown_and_bad_input_are_typed(rc: RayCluster) -> None:
    """Six requests at once for "held" (one queue place on each node): at least four are Overloaded, the others
    time out; an unknown model and a bad input are the client's UnknownModel and BadInput; over HTTP 503, 404, 400."""
    x = tiny_inputs(1, seed=5)[0]

    async def calls() -> tuple[list[str], BaseException | None, BaseException | None]:
        bh = BrokerHandle(rc.handle)
        outcomes = await asyncio.gather(*(bh.infer("held", x, timeout=2.0) for _ in range(6)), return_exceptions=True)
        errors: list[BaseException | None] = []
        for call in (bh.infer("nope", x), bh.infer("tiny", x.astype(np.float64))):
            try:
                await call
                errors.append(None)
            except Exception as exc:
                errors.append(exc)
        return [type(o).__name__ for o in outcomes], errors[0], errors[1]

    names, unknown, bad = run(calls())
    count = collections.Counter(names)
    assert set(count) <= {"Overloaded", "RequestTimeout"} and count["Overloaded"] >= 4, count
    assert isinstance(unknown, UnknownModel) and "models are" in str(unknown), repr(unknown)
    assert isinstance(bad, BadInput) and bad.code == "BAD_DTYPE", repr(bad)
    conn = rc.http()
    try:
        status, _, body = _post(conn, "/v2/models/nope/infer", b"{}")
        assert status == 404 and "not served" in json.loads(body)["error"], body
        status, _, body = _post(conn, "/v2/models/tiny/infer", b'{"inputs": [{"name": "x"}]}')
        assert status == 400 and "inputs[0].datatype" in json.loads(body)["error"], body
        status, _, body = _get(conn, "/v2/nowhere")
        assert status == 404, body
    finally:
        conn.close()
    held = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 256], "data": x.ravel().tolist()}],
            "parameters": {"timeout": 2_000_000}}

    def post_held(_: int) -> int:
        c = rc.http()
        try:
            return _post(c, "/v2/models/held/infer", json.dumps(held).encode())[0]
        finally:
            c.close()

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(4) as pool:
        statuses = collections.Counter(pool.map(post_held, range(4)))
    assert set(statuses) <= {503, 504} and statuses[503] >= 2, statuses  # the proxy's node: one queue place


def test_ray_failures_come_as_the_clients_types() -> None:
    """What a Ray call itself raises reaches the caller as the client's error types."""
    died = typed(ActorDiedError())
    assert isinstance(died, WorkerDied) and "send the request again" in str(died)
    assert isinstance(typed(RuntimeError("x")), Exception) and typed(RuntimeError("x")).code == "INTERNAL"
    over = Overloaded("queue full")
    assert typed(over) is over


def test_build_app_names_a_wrong_argument() -> None:
    with pytest.raises(ValueError, match=r"unknown argument\(s\) \['node'\]; expected \['max_items', 'nodes'"):
        build_app({"node": 2})
    with pytest.raises(ValueError, match=r"nodes='two': expected int"):
        build_app({"nodes": "two"})
    with pytest.raises(ValueError, match=r"nodes=0: expected at least 1"):
        build_app({"nodes": 0})
    with pytest.raises(ValueError, match=r"startup_wait_s=0.0: expected seconds, more than 0"):
        build_app({"startup_wait_s": "0"})
    opts = node_broker.options(num_replicas=3)
    assert opts.num_replicas == 3 and node_broker.ray_actor_options["resources"] == {NODE_RESOURCE: 0.01}


# -- a node's broker dies under load ---------------------------------------------------------------------------------


@dataclass
class Outcome:
    sent: float  # time.monotonic()
    done: float
    result: str  # "OK", or the exception's class name
    index: int = 0


class Load:
    """``IN_FLIGHT`` chains of tiny requests through a BrokerHandle on a thread of its own, until stopped; each
    request's outcome recorded with its send and answer times, each OK answer checked against its own input."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle
        self.stop = threading.Event()
        self.outcomes: list[Outcome] = []
        self.sent = 0
        self.wrong: list[int] = []
        self.xs = tiny_inputs(256, seed=6)
        self.refs = [direct("tiny", x) for x in self.xs]
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), name="ray-load", daemon=True)
        self.thread.start()

    async def _run(self) -> None:
        bh = BrokerHandle(self.handle)

        async def chain() -> None:
            while not self.stop.is_set():
                i = self.sent % len(self.xs)
                self.sent += 1
                t0 = time.monotonic()
                try:
                    y = arr(await bh.infer("tiny", self.xs[i], timeout=10))
                    result = "OK"
                    if not np.allclose(y, self.refs[i], rtol=0, atol=1e-5):
                        self.wrong.append(i)
                except Exception as exc:
                    result = type(exc).__name__
                self.outcomes.append(Outcome(t0, time.monotonic(), result, i))

        await asyncio.gather(*(chain() for _ in range(IN_FLIGHT)))

    def only_ok_since(self, t: float, n: int) -> bool:
        """The last ``n`` answers were all OK, for requests sent after ``t``."""
        last = list(self.outcomes)[-n:]
        return len(last) == n and all(o.result == "OK" and o.sent > t for o in last)

    def ok_sent_after(self, t: float) -> list[Outcome]:
        return [o for o in list(self.outcomes) if o.result == "OK" and o.sent > t]

    def finish(self, limit: float) -> None:
        self.stop.set()
        self.thread.join(limit)
        assert not self.thread.is_alive(), f"requests still unanswered {limit:g} s after the load stopped"


def test_a_node_whose_broker_dies_under_load(rc: RayCluster) -> None:
    """SIGKILL node a's broker under 32 requests in flight: every request is answered once, OK or a typed error,
    none hangs; node b serves requests sent after the kill within 5 s; Ray Serve stops routing to node a (its
    replica fails its health checks and is taken out), and routes to it again once its broker is back."""
    a, b = rc.nodes
    load = Load(rc.handle)
    try:
        wait_until(lambda: len(load.ok_sent_after(0)) >= 200, "200 requests answered before the kill", 60)
        b_before = b.ok()
        t_kill = time.monotonic()
        os.kill(a.broker.proc.pid, signal.SIGKILL)
        a.broker.proc.wait(10)
        wait_until(lambda: bool(load.ok_sent_after(t_kill)), "a request sent after the kill answered OK", 60)
        failover_s = min(o.done for o in load.ok_sent_after(t_kill)) - t_kill
        wait_until(lambda: b.ok() > b_before, "node b's broker answered after the kill", 30)
        wait_until(lambda: load.only_ok_since(t_kill, 300), "Ray Serve routing to node b alone: 300 OK in a row", 90)
        out_s = time.monotonic() - t_kill
        a.restart()
        t_back = time.monotonic()
        wait_until(lambda: a.ok() >= 50, "node a's restarted broker serving through Ray again", 120)
        back_s = time.monotonic() - t_back
    finally:
        load.finish(60)
    count = collections.Counter(o.result for o in load.outcomes)
    print(f"failover: first OK of a request sent after the kill {failover_s:.2f} s after it; node a out of routing "
          f"{out_s:.1f} s after the kill; serving again {back_s:.1f} s after its broker restarted; outcomes "
          f"{dict(count)}")
    assert len(load.outcomes) == load.sent, f"{load.sent} sent, {len(load.outcomes)} answered"
    assert set(count) <= {"OK", "WorkerDied", "RequestTimeout", "Overloaded"}, count
    assert not load.wrong, f"answers of other requests for inputs {load.wrong[:10]}"
    assert failover_s <= FAILOVER_BOUND_S, (
        f"node b served the first request sent after node a's broker was killed {failover_s:.2f} s after the kill; "
        f"the bound is {FAILOVER_BOUND_S:g} s")
    wait_until(_serve_running, "the shmbroker application RUNNING with both replicas", 60)


def test_a_new_model_rolls_out_one_node_at_a_time(rc: RayCluster) -> None:
    """DEPLOY.md's roll-out: each node's broker restarted in turn on a config with one more model. A session
    cannot take its old place on a broker of other models, so the node's replica fails its health checks and
    Ray Serve replaces it with one that sees the new model; meanwhile the other node serves the old ones."""
    wait_until(_serve_running, "the shmbroker application RUNNING with both replicas", 60)
    new_model = MODELS + '\n[models.tiny2]\npath = "builtin:tiny"\nmax_batch = 4\nintra_op_threads = 1\n'
    x = tiny_inputs(1, seed=7)[0]

    async def outcomes(model: str, n: int) -> collections.Counter[str]:
        bh = BrokerHandle(rc.handle, coalesce=1)
        got = await asyncio.gather(*(bh.infer(model, x, timeout=30) for _ in range(n)), return_exceptions=True)
        return collections.Counter("OK" if isinstance(g, np.ndarray) else f"{type(g).__name__}: {g}" for g in got)

    for name, node in zip("ab", rc.nodes, strict=True):
        node.broker.stop()
        node.broker = start_broker(node.tmp, "process", models=new_model, sessions=SESSIONS)

        def serves_new_model(node: Node = node) -> bool:
            run(outcomes("tiny2", 8))
            return node.ok("tiny2") > 0

        wait_until(serves_new_model, f"node {name}'s broker answering the new model through Ray", 120)
    # each node's replica is the new one (one replica a node: the old one is gone), and serves every model
    assert run(outcomes("tiny2", 16)) == {"OK": 16}
    assert run(outcomes("tiny", 16)) == {"OK": 16}
