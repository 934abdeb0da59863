"""The load generator: one spawned process per part, each keeping ``in_flight`` one-row requests outstanding.

Every process sends the rows of a small fixed set in turn and checks every answer against the engine's own
output for that row (``answers.Checker``). Each server is driven by its own fastest client:

* ``ring``: shmbroker's ``Client.call`` chains (each answer's callback submits the next request);
* ``kserve``: KServe v2 / Triton HTTP with binary tensor data (``shmbroker http``, and Triton's HTTP port), on
  aiohttp + uvloop with one keep-alive connection per request in flight;
* ``raw``: a POST whose body is the row's raw bytes and whose answer is the output row's (LitServe, FastAPI),
  on the same aiohttp + uvloop client;
* ``triton-grpc``: Triton's gRPC with tritonclient's ``async_infer`` chains (its callbacks on gRPC's threads).

A request is timed from just before it is sent to its answer; only answers inside the window count. The window
starts ``warmup_s`` after the barrier that starts every process together, and is reported on the system-wide
monotonic clock with the process's own CPU seconds over it.
"""

from __future__ import annotations

import asyncio
import collections
import json
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from shmbroker.bench.common import ChainSet
from shmbroker.bench.peers.answers import Checker, Tally
from shmbroker.bench.procs import Sync

DRAIN_S = 30.0  # how long after the window a process waits for its last answers


class Window:
    """The counted span of one process, and its CPU seconds over it (a timer thread reads them at its ends)."""

    def __init__(self, warmup_s: float, duration_s: float) -> None:
        now_ns, now_mono = time.perf_counter_ns(), time.monotonic()
        self.count_ns = now_ns + int(warmup_s * 1e9)
        self.end_ns = self.count_ns + int(duration_s * 1e9)
        self.monotonic = [now_mono + warmup_s, now_mono + warmup_s + duration_s]
        self.duration_s = duration_s
        self.cpu = [0.0, 0.0]
        self._timer = threading.Thread(target=self._read_cpu, args=(warmup_s, duration_s), name="bench-cpu",
                                       daemon=True)
        self._timer.start()

    def _read_cpu(self, warmup_s: float, duration_s: float) -> None:
        tick = threading.Event()  # never set: its wait is the timer
        tick.wait(warmup_s)
        self.cpu[0] = time.process_time()
        tick.wait(duration_s)
        self.cpu[1] = time.process_time()

    def inside(self, t_ns: int) -> bool:
        return self.count_ns <= t_ns < self.end_ns

    def open(self, t_ns: int) -> bool:
        return t_ns < self.end_ns

    def result(self, samples: list[int], errors: collections.Counter[str], tally: Tally, in_flight: int,
               lost: int) -> dict[str, Any]:
        self._timer.join(DRAIN_S)
        return {"completed": len(samples), "errors": sum(errors.values()), "error_codes": dict(errors),
                "latency_ns": np.asarray(samples, dtype=np.int64), "window_s": self.duration_s,
                "window_monotonic": self.monotonic, "cpu_s": self.cpu[1] - self.cpu[0], "in_flight": in_flight,
                "answers": tally.as_dict(), "lost": lost}


def checker(spec: dict[str, Any]) -> Checker:
    return Checker(np.asarray(spec["reference"]), float(spec["tolerance"]))


# ---- ring: Client.call chains ----------------------------------------------------------------------------------


class _Chains(ChainSet):
    """``n`` chains of ``Client.call``; chain i's request went out at ``sent[i]`` with row ``row[i]``."""

    def __init__(self, client: Any, model: str, rows: np.ndarray, check: Checker, window: Window, n: int) -> None:
        super().__init__(n)
        self.client, self.model, self.rows, self.check, self.window = client, model, rows, check, window
        self.sent, self.row = [0] * n, [0] * n
        self.next_row = 0
        self.samples: list[int] = []
        self.errors: collections.Counter[str] = collections.Counter()

    def launch(self, i: int) -> None:
        from shmbroker.client import ShmBrokerError

        with self.lock:
            k = self.row[i] = self.next_row
            self.next_row += 1
        self.sent[i] = time.perf_counter_ns()
        try:
            self.client.call(self.model, self.rows[k % len(self.rows)][None],
                             lambda out, exc: self.done(i, out, exc))
        except ShmBrokerError as exc:
            with self.lock:
                self.errors[f"submit:{exc.code}"] += 1
            self._ended()

    def done(self, i: int, out: Any, exc: Any) -> None:
        t = time.perf_counter_ns()
        if self.window.inside(t):
            with self.lock:
                if exc is not None:
                    self.errors[str(getattr(exc, "code", type(exc).__name__))] += 1
                elif self.check.check(self.row[i], next(iter(out.values())) if isinstance(out, dict) else out):
                    self.samples.append(t - self.sent[i])
                else:
                    self.errors["wrong answer"] += 1
        if self.window.open(t):
            self.launch(i)
        else:
            self._ended()


def ring_client(spec: dict[str, Any], sync: Sync) -> dict[str, Any]:
    """A process with its own shmbroker session; ``in_flight`` chains of ``Client.call``."""
    from shmbroker.client import Client

    rows, n = np.asarray(spec["rows"]), int(spec["in_flight"])
    check = checker(spec)
    with Client(spec["runtime_dir"], slots=max(2 * n, 4), name=f"bench-peers-{spec['index']}") as c:
        for k in range(spec["warmup_requests"]):
            c.infer(spec["model"], rows[k % len(rows)][None])
        sync()
        window = Window(spec["warmup_s"], spec["duration_s"])
        chains = _Chains(c, spec["model"], rows, check, window, n)
        for i in range(n):
            chains.launch(i)
        drained = chains.drained.wait(spec["warmup_s"] + spec["duration_s"] + DRAIN_S)
        with chains.lock:
            return window.result(list(chains.samples), collections.Counter(chains.errors), check.tally, n,
                                 0 if drained else chains.live)


# ---- HTTP: raw bodies and KServe v2 binary, on aiohttp + uvloop ---------------------------------------------------

Request = tuple[str, bytes, dict[str, str]]  # url, body, headers


def raw_requests(spec: dict[str, Any]) -> list[Request]:
    """One POST per row: the row's bytes as an octet-stream body."""
    headers = {"Content-Type": "application/octet-stream"}
    return [(spec["url"], np.ascontiguousarray(r).tobytes(), headers) for r in np.asarray(spec["rows"])]


def kserve_datatype(dtype: str) -> str:
    from shmbroker.frontend.kserve import NUMPY_OF

    names = {v: k for k, v in NUMPY_OF.items()}
    return names[np.dtype(dtype)]


def kserve_requests(spec: dict[str, Any]) -> list[Request]:
    """One binary-data infer request per row (KServe v2 / Triton's binary tensor extension)."""
    mi = spec["model_info"]
    out: list[Request] = []
    for r in np.asarray(spec["rows"]):
        x = np.ascontiguousarray(r[None])
        header = json.dumps({
            "inputs": [{"name": mi["input_name"], "datatype": kserve_datatype(mi["input_dtype"]),
                        "shape": list(x.shape), "parameters": {"binary_data_size": x.nbytes}}],
            "outputs": [{"name": mi["output_name"], "parameters": {"binary_data": True}}],
        }).encode()
        out.append((spec["url"], header + x.tobytes(),
                    {"Inference-Header-Content-Length": str(len(header)),
                     "Content-Type": "application/octet-stream"}))
    return out


def kserve_output(body: bytes, header_length: str | None) -> bytes:
    """The first output's binary data of a KServe v2 binary response; ValueError when it has none."""
    if header_length is None:
        raise ValueError("the response has no Inference-Header-Content-Length: no binary output")
    n = int(header_length)
    doc = json.loads(body[:n])
    size = int(doc["outputs"][0]["parameters"]["binary_data_size"])
    return body[n : n + size]


async def _http(spec: dict[str, Any], sync: Sync, requests: list[Request],
                answer: Callable[[bytes, Any], bytes]) -> dict[str, Any]:
    import aiohttp

    n, dtype = int(spec["in_flight"]), spec["model_info"]["output_dtype"]
    check = checker(spec)
    samples: list[int] = []
    errors: collections.Counter[str] = collections.Counter()
    connector = aiohttp.TCPConnector(limit=n, force_close=False)
    timeout = aiohttp.ClientTimeout(total=spec.get("request_timeout_s", 60.0))
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as s:

        async def one(k: int) -> tuple[int, bytes, Any]:
            url, body, headers = requests[k % len(requests)]
            async with s.post(url, data=body, headers=headers) as r:
                return r.status, await r.read(), r.headers

        for k in range(spec["warmup_requests"]):
            status, body, _ = await one(k)
            if status != 200:
                raise RuntimeError(f"warm-up request to {spec['url']}: HTTP {status}: {body[:300]!r}")
        await asyncio.get_running_loop().run_in_executor(None, sync)
        window = Window(spec["warmup_s"], spec["duration_s"])
        counter = iter(range(1 << 62))

        async def chain() -> None:
            while window.open(t0 := time.perf_counter_ns()):
                k = next(counter)
                try:
                    status, body, headers = await one(k)
                except (aiohttp.ClientError, TimeoutError) as exc:
                    status, body, headers = -1, type(exc).__name__.encode(), {}
                t1 = time.perf_counter_ns()
                if not window.inside(t1):
                    continue
                if status != 200:
                    errors[f"HTTP {status}" if status > 0 else body.decode()] += 1
                    continue
                try:
                    ok = check.check_bytes(k, answer(body, headers), dtype)
                except (ValueError, KeyError, IndexError) as exc:
                    ok = check.unreadable(k, f"{type(exc).__name__}: {exc}")
                if ok:
                    samples.append(t1 - t0)
                else:
                    errors["wrong answer"] += 1

        await asyncio.gather(*(chain() for _ in range(n)))
    return window.result(samples, errors, check.tally, n, 0)


def _run_http(spec: dict[str, Any], sync: Sync, requests: list[Request], answer: Callable[[bytes, Any], bytes]
              ) -> dict[str, Any]:
    import uvloop

    return uvloop.run(_http(spec, sync, requests, answer))


def raw_client(spec: dict[str, Any], sync: Sync) -> dict[str, Any]:
    return _run_http(spec, sync, raw_requests(spec), lambda body, headers: body)


def kserve_client(spec: dict[str, Any], sync: Sync) -> dict[str, Any]:
    return _run_http(spec, sync, kserve_requests(spec),
                     lambda body, headers: kserve_output(body, headers.get("Inference-Header-Content-Length")))


# ---- Triton gRPC: tritonclient async_infer chains -----------------------------------------------------------------


def triton_grpc_client(spec: dict[str, Any], sync: Sync) -> dict[str, Any]:
    """``in_flight`` chains of ``async_infer`` on one channel; each callback (a gRPC thread) sends the next."""
    import tritonclient.grpc as grpcclient

    mi, n = spec["model_info"], int(spec["in_flight"])
    rows = np.asarray(spec["rows"])
    check = checker(spec)
    datatype = kserve_datatype(mi["input_dtype"])
    inputs = []
    for r in rows:
        inp = grpcclient.InferInput(mi["input_name"], [1, *r.shape], datatype)
        inp.set_data_from_numpy(np.ascontiguousarray(r[None]))
        inputs.append([inp])
    outputs = [grpcclient.InferRequestedOutput(mi["output_name"])]
    client = grpcclient.InferenceServerClient(spec["url"])
    model = spec["model"]
    try:
        for k in range(spec["warmup_requests"]):
            client.infer(model, inputs[k % len(inputs)], outputs=outputs)
        sync()
        window = Window(spec["warmup_s"], spec["duration_s"])
        lock = threading.Lock()
        samples: list[int] = []
        errors: collections.Counter[str] = collections.Counter()
        sent, row = [0] * n, [0] * n
        state = {"next": 0, "live": n}
        drained = threading.Event()

        def answer_ok(k: int, result: Any) -> bool:
            try:
                return check.check(k, result.as_numpy(mi["output_name"]))
            except (ValueError, TypeError, KeyError) as exc:  # an answer with no readable output
                return check.unreadable(k, f"{type(exc).__name__}: {exc}")

        def launch(i: int) -> None:
            with lock:
                k = row[i] = state["next"]
                state["next"] += 1
            sent[i] = time.perf_counter_ns()
            client.async_infer(model, inputs[k % len(inputs)], lambda result, error: done(i, result, error),
                               outputs=outputs)

        def done(i: int, result: Any, error: Any) -> None:
            t = time.perf_counter_ns()
            if window.inside(t):
                with lock:
                    if error is not None:
                        errors[f"gRPC {getattr(error, 'status', lambda: '')() or type(error).__name__}"] += 1
                    elif answer_ok(row[i], result):
                        samples.append(t - sent[i])
                    else:
                        errors["wrong answer"] += 1
            if window.open(t):
                try:
                    launch(i)
                    return
                except Exception as exc:  # noqa: BLE001 - on gRPC's thread: count it, end this chain
                    with lock:
                        errors[f"submit: {type(exc).__name__}"] += 1
            with lock:
                state["live"] -= 1
                if state["live"] <= 0:
                    drained.set()

        for i in range(n):
            launch(i)
        ok = drained.wait(spec["warmup_s"] + spec["duration_s"] + DRAIN_S)
        with lock:
            return window.result(list(samples), collections.Counter(errors), check.tally, n,
                                 0 if ok else state["live"])
    finally:
        client.close()


CLIENTS: dict[str, Callable[[dict[str, Any], Sync], dict[str, Any]]] = {
    "ring": ring_client, "kserve": kserve_client, "raw": raw_client, "triton-grpc": triton_grpc_client,
}


def client(spec: dict[str, Any], sync: Sync) -> dict[str, Any]:
    """The process target (bench.procs.run_group): the client of ``spec["protocol"]``."""
    return CLIENTS[spec["protocol"]](spec, sync)
