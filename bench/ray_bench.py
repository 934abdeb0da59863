"""``shmbroker bench --ray`` (or ``python -m shmbroker.bench.ray_bench``): the same load through Ray Serve's handle,
through its HTTP proxy and through the direct client to one broker, in one run, with what Ray adds per request.

One broker (``tiny`` alone, as configs/default.toml has it), one Ray node started here (``ray.init``: its GCS,
raylet, Serve controller, HTTP proxy and one ``NodeBroker`` replica, all children of this process), and 32
requests in flight from this process, one row each, in closed-loop chains: the direct ``AsyncClient``, then
``BrokerHandle`` (its default coalescing), ``BrokerHandle(coalesce=1)`` (one Ray call a request), the KServe v2
binary body over Ray's HTTP proxy (aiohttp, keep-alive), then the direct client again; ratios are over the mean
of the two direct runs, so a drift of the machine cancels out. CPU per request is the CPU time of this process
and all its descendants (broker, worker, every Ray process) over each window, divided by the requests answered
in it; what Ray adds is that less the direct client's. The target: the handle path at least 0.5 x the direct
client. Serve's own switches (``RAY_SERVE_THROUGHPUT_OPTIMIZED=1``, ``RAY_SERVE_ENABLE_HA_PROXY=1``) apply when
set in the environment, and the JSON records them. JSON on stdout (``--out`` for a file), progress on stderr. Figures:
bench/RESULTS.md#ray-serve-in-front-of-the-broker.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import socket
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np

from shmbroker.bench import procs
from shmbroker.bench.broker_proc import BrokerProcess
from shmbroker.bench.common import BenchError, Figures, Progress, emit, latency_summary
from shmbroker.broker.common import runtime

IN_FLIGHT = 32
TARGET = 0.5  # handle path / direct AsyncClient
MODEL = "tiny"
CONFIG = """
[broker]
handshake_timeout_ms = 20000
[sessions]
default_slots = 64
[worker]
devices = ["cpu"]
[models.tiny]
path = "builtin:tiny"
max_batch = 64
max_queue_delay_us = 0
max_queue_size = 1024
timeout_ms = 5000
intra_op_threads = 1
"""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the HTTP proxy's)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


async def chains(call: Callable[[], Awaitable[object]], warmup_s: float, window_s: float) -> Figures:
    """``IN_FLIGHT`` chains of ``call`` for ``warmup_s`` then ``window_s``; the window's answers, latency, errors
    and CPU."""
    clock = time.perf_counter_ns
    count_ns = clock() + int(warmup_s * 1e9)
    end_ns = count_ns + int(window_s * 1e9)
    samples: list[int] = []
    errors: collections.Counter[str] = collections.Counter()
    cpu: list[float] = []

    async def chain() -> None:
        while (t0 := clock()) < end_ns:
            try:
                await call()
                ok = True
            except Exception as exc:  # noqa: BLE001 - counted by type: a bench reports errors, it does not stop
                errors[type(exc).__name__] += 1
                ok = False
            t1 = clock()
            if ok and count_ns <= t1 < end_ns:
                samples.append(t1 - t0)

    async def meter() -> None:  # the window's edges on the clock; not a readiness wait
        await asyncio.sleep(max(0.0, (count_ns - clock()) / 1e9))
        cpu.append(procs.tree_cpu_s([os.getpid()]))
        await asyncio.sleep(max(0.0, (end_ns - clock()) / 1e9))
        cpu.append(procs.tree_cpu_s([os.getpid()]))

    await asyncio.gather(meter(), *(chain() for _ in range(IN_FLIGHT)))
    done = len(samples)
    cpu_s = cpu[1] - cpu[0]
    return {"completed": done, "per_s": round(done / window_s, 1), "errors": sum(errors.values()),
            "error_types": dict(errors), "latency": latency_summary(samples), "cpu_s": round(cpu_s, 3),
            "cpu_us_per_request": round(cpu_s / done * 1e6, 1) if done else None}


def http_body(x: np.ndarray) -> tuple[bytes, dict[str, str]]:
    """A one-row KServe v2 request with binary tensor data both ways."""
    header = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": list(x.shape),
                                     "parameters": {"binary_data_size": x.nbytes}}],
                         "parameters": {"binary_data_output": True}}).encode()
    return header + x.tobytes(), {"Inference-Header-Content-Length": str(len(header)),
                                  "Content-Type": "application/octet-stream"}


async def measure(progress: Progress, runtime_dir: Path, handle: Any, url: str, warmup_s: float,
                  window_s: float, rows: int) -> dict[str, Figures]:
    import aiohttp

    from shmbroker.client import AsyncClient
    from shmbroker.ray import BrokerHandle

    x = np.full((rows, 256), 0.25, np.float32)
    body, headers = http_body(x)
    points: dict[str, Figures] = {}

    async def point(name: str, call: Callable[[], Awaitable[object]]) -> None:
        progress.phase(f"{name}: {IN_FLIGHT} in flight, {warmup_s:g} s warm-up, {window_s:g} s window")
        f = points[name] = await chains(call, warmup_s, window_s)
        f["rows_per_s"] = round(f["per_s"] * rows, 1)
        if not f["completed"]:
            raise BenchError(f"{name}: no request completed inside the window; errors {f['error_types']}")
        progress.done(f"{f['per_s']:,.1f}/s, p50 {f['latency']['p50_us']:,.0f} us, "
                      f"{f['cpu_us_per_request']:,.0f} us CPU a request, {f['errors']} errors")

    async with AsyncClient(runtime_dir, slots=2 * IN_FLIGHT, name="bench-ray-direct") as ac:
        await point("direct", lambda: ac.infer(MODEL, x))
        batched, single = BrokerHandle(handle), BrokerHandle(handle, coalesce=1)
        await point("handle", lambda: batched.infer(MODEL, x))
        await point("handle_per_call", lambda: single.infer(MODEL, x))
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=IN_FLIGHT)) as s:

            async def post() -> None:
                async with s.post(f"{url}/v2/models/{MODEL}/infer", data=body, headers=headers) as r:
                    await r.read()
                    if r.status != 200:
                        raise BenchError(f"HTTP {r.status}")

            await point("http", post)
        await point("direct_again", lambda: ac.infer(MODEL, x))
    return points


def summary(points: dict[str, Figures]) -> Figures:
    direct_per_s = (points["direct"]["per_s"] + points["direct_again"]["per_s"]) / 2
    direct_cpu = np.mean([points[k]["cpu_us_per_request"] for k in ("direct", "direct_again")])
    out: Figures = {"direct_per_s_mean": round(direct_per_s, 1),
                    "direct_cpu_us_per_request_mean": round(float(direct_cpu), 1)}
    for name in ("handle", "handle_per_call", "http"):
        p = points[name]
        out[f"{name}_over_direct"] = round(p["per_s"] / direct_per_s, 3)
        out[f"{name}_added_cpu_us_per_request"] = round(p["cpu_us_per_request"] - float(direct_cpu), 1)
        out[f"{name}_added_p50_us"] = round(p["latency"]["p50_us"] - points["direct"]["latency"]["p50_us"], 1)
    out["target_handle_over_direct"] = TARGET
    out["met"] = out["handle_over_direct"] >= TARGET
    return out


def table(doc: Figures) -> str:
    env = " ".join(f"{k}={v}" for k, v in doc["ray_serve_env"].items()) or "Serve's defaults"
    lines = [f"Ray Serve ({doc['ray_version']}, one node, {env}) vs the direct AsyncClient, {MODEL}, {IN_FLIGHT} in "
             f"flight, {doc['rows']} row(s) a request",
             f"{'path':<16} {'per s':>10} {'p50 us':>9} {'p99 us':>9} {'CPU us/req':>11} {'errors':>7}", "-" * 66]
    for name, p in doc["points"].items():
        lines.append(f"{name:<16} {p['per_s']:>10,.1f} {p['latency']['p50_us']:>9,.0f} {p['latency']['p99_us']:>9,.0f} "
                     f"{p['cpu_us_per_request']:>11,.0f} {p['errors']:>7}")
    s = doc["summary"]
    for name in ("handle", "handle_per_call", "http"):
        lines.append(f"{name} / direct = {s[f'{name}_over_direct']:.3f}; Ray adds "
                     f"{s[f'{name}_added_cpu_us_per_request']:,.0f} us CPU and {s[f'{name}_added_p50_us']:,.0f} us "
                     "p50 a request")
    lines.append(f"handle / direct target >= {TARGET}: {'met' if s['met'] else 'MISSED'}")
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> Figures:
    import ray
    from ray import serve

    from shmbroker.bench.report import machine
    from shmbroker.ray import NODE_RESOURCE, build_app

    progress = Progress()
    window_s = args.duration if args.duration is not None else (2.0 if args.quick else 5.0)
    warmup_s = 0.5 if args.quick else 1.0
    workdir = Path(tempfile.mkdtemp(prefix="shmbroker-bench-ray-"))
    cfg = workdir / "bench-ray.toml"
    cfg.write_text(CONFIG)
    doc: Figures = {"schema": "shmbroker-bench-ray/1", "machine": machine(), "ray_version": ray.__version__,
                    # Serve's own switches, as set for this run (RAY_SERVE_THROUGHPUT_OPTIMIZED, ...)
                    "ray_serve_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("RAY_SERVE_")},
                    "model": MODEL, "in_flight": IN_FLIGHT, "rows": args.rows, "window_s": window_s,
                    "warmup_s": warmup_s,
                    "config": CONFIG, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    with BrokerProcess(cfg, workdir, progress) as broker:
        progress.phase("starting one Ray node and the shmbroker application (Serve controller, HTTP proxy, replica)")
        # the node's raylet, and so the replica, inherit these: the broker's directory, and no usage report
        os.environ[runtime.ENV_VAR] = str(broker.runtime_dir)
        os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
        ray.init(num_cpus=2, resources={NODE_RESOURCE: 1}, include_dashboard=False, object_store_memory=100 << 20,
                 log_to_driver=False)
        try:
            port = free_port()
            serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
            handle = serve.run(build_app({"nodes": 1}), name="shmbroker", route_prefix="/")
            progress.done(f"HTTP proxy on 127.0.0.1:{port}")

            async def measured() -> dict[str, Figures]:
                try:
                    return await measure(progress, broker.runtime_dir, handle, f"http://127.0.0.1:{port}", warmup_s,
                                         window_s, args.rows)
                finally:  # on the loop that the handle's router may live on (RAY_SERVE_THROUGHPUT_OPTIMIZED=1)
                    await serve.shutdown_async()

            doc["points"] = asyncio.run(measured())
        finally:
            ray.shutdown()  # the node this process started, with whatever of Serve is left on it
    doc["broker"] = broker.shutdown_figures()
    doc["summary"] = summary(doc["points"])
    return doc


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--duration", type=float, default=None, metavar="SECONDS",
                    help="each window (default 5, 2 with --quick)")
    ap.add_argument("--quick", action="store_true", help="2 s windows after 0.5 s of warm-up")
    ap.add_argument("--rows", type=int, default=1, metavar="N",
                    help="rows a request (default 1; at most 64, tiny's max_batch): Ray's cost is a call's, not a "
                         "row's")
    ap.add_argument("--out", default=None, metavar="FILE", help="write the JSON document to FILE too")


def main(args: argparse.Namespace) -> int:
    if not 1 <= args.rows <= 64:
        sys.stderr.write(f"shmbroker bench --ray: --rows: expected 1..64 (tiny's max_batch), got {args.rows}\n")
        return 2
    try:
        import ray  # noqa: F401 -- the [ray] extra, named when missing
    except ImportError:
        sys.stderr.write("shmbroker bench --ray: needs Ray Serve: pip install 'shmbroker[ray]'\n")
        return 2
    doc = run(args)
    sys.stderr.write(table(doc))
    emit(doc, args.out)
    return 0 if doc["broker"]["shm_clean"] else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
