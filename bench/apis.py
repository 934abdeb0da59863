"""``python -m shmbroker.bench.apis``: the ways to keep requests in flight, against each other, in one run.

Each round measures, on the bench's own broker and the ``tiny`` model: the callback API (``Client.call`` chains,
``--processes`` processes), Futures (``Client.submit``, the same processes, each waiting on its oldest Future
before it submits the next) and ``AsyncClient`` (one process, one task per request in flight); for information, the
zero-copy forms of the callbacks (``request()`` filled in place, then ``call``) and of AsyncClient (``request()``,
then ``submit()``), whose inputs are small here, so they show the cost and none of the saving; and threads each
calling ``infer()`` in a loop (``--processes`` processes). No API inspects its answers inside the window (the
end-to-end tests check them), so none pays for it. Every API keeps ``--in-flight`` requests in flight in all. The
targets: Futures and AsyncClient each at least 0.8 x the callbacks, the median of the rounds' ratios. JSON on
stdout (``--out`` for a file), progress on stderr. Figures: bench/RESULTS.md#client-apis.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from shmbroker.bench import report
from shmbroker.bench.broker_proc import BrokerProcess
from shmbroker.bench.common import Figures, Progress, emit
from shmbroker.bench.gpu_load import Loops
from shmbroker.bench.load import throughput_client
from shmbroker.bench.procs import Sync, run_group
from shmbroker.client import AsyncClient, Client

MODEL = "tiny"
TARGET = 0.8
APIS = ("call", "submit", "async", "zero", "async_zero", "infer")


def _started(c: Client, x: np.ndarray, spec: dict[str, Any], sync: Sync) -> tuple[float, float]:
    """Warm ``c`` up, wait for the others, and return the window (start of counting, end) on perf_counter."""
    for _ in range(spec["warmup_requests"]):
        c.infer(MODEL, x)
    sync()
    t0 = time.perf_counter()
    return t0 + spec["warmup_s"], t0 + spec["warmup_s"] + spec["duration_s"]


def submit_client(spec: dict[str, Any], sync: Sync) -> Figures:
    """``in_flight`` Futures outstanding: wait on the oldest, check it, submit the next."""
    in_flight: int = spec["in_flight"]
    with Client(spec["runtime_dir"], slots=2 * in_flight, name=f"bench-submit-{spec['index']}") as c:
        x = np.full((1, 256), 0.25 + spec["index"], np.float32)
        t_count, t_end = _started(c, x, spec, sync)
        pending = collections.deque(c.submit(MODEL, x) for _ in range(in_flight))
        completed = 0
        while pending:
            pending.popleft().result(30)
            now = time.perf_counter()
            if t_count <= now < t_end:
                completed += 1
            if now < t_end:
                pending.append(c.submit(MODEL, x))
    return {"completed": completed, "errors": 0, "error_codes": {}}


def infer_client(spec: dict[str, Any], sync: Sync) -> Figures:
    """``in_flight`` threads (the first is this one), each calling ``Client.infer`` in a loop, as a synchronous
    application does (bench.gpu_load's ``Loops``); the requests that end inside the window count."""
    in_flight: int = spec["in_flight"]
    with Client(spec["runtime_dir"], slots=2 * in_flight, name=f"bench-infer-{spec['index']}") as c:
        x = np.full((1, 256), 0.125 + spec["index"], np.float32)
        t_count, t_end = _started(c, x, spec, sync)
        loops = Loops(c, MODEL, x, t_count, t_end, in_flight)
        loops.run(30.0)
    return {"completed": len(loops.samples), "errors": sum(loops.errors.values()), "error_codes": dict(loops.errors)}


def zero_client(spec: dict[str, Any], sync: Sync) -> Figures:
    """``in_flight`` chains of zero-copy requests: each callback fills a held slot in place and ``call``s it."""
    in_flight: int = spec["in_flight"]
    with Client(spec["runtime_dir"], slots=2 * in_flight, name=f"bench-zero-{spec['index']}") as c:
        x = np.full((1, 256), 0.5 + spec["index"], np.float32)
        t_count, t_end = _started(c, x, spec, sync)
        counted, live, drained = [0], [in_flight], threading.Event()

        def send() -> None:
            with c.request(MODEL) as req:
                np.copyto(req.inputs["x"], x)
                req.call(done)

        def done(_out: object, err: object) -> None:
            now = time.perf_counter()
            if err is None and t_count <= now < t_end:
                counted[0] += 1
            if now < t_end:
                send()
            else:
                live[0] -= 1  # the client's one receiving thread runs every callback
                if not live[0]:
                    drained.set()

        for _ in range(in_flight):
            send()
        drained.wait(spec["warmup_s"] + spec["duration_s"] + 30)
    return {"completed": counted[0], "errors": 0, "error_codes": {}}


async def _async_window(spec: dict[str, Any]) -> Figures:
    async with AsyncClient(spec["runtime_dir"], slots=2 * spec["in_flight"], name="bench-async") as c:
        x = np.full((1, 256), 0.75, np.float32)
        for _ in range(spec["warmup_requests"]):
            await c.infer(MODEL, x)
        counted = [0]
        t0 = time.perf_counter()
        t_count, t_end = t0 + spec["warmup_s"], t0 + spec["warmup_s"] + spec["duration_s"]

        async def one() -> object:
            if not spec.get("zero"):
                return await c.infer(MODEL, x)
            async with c.request(MODEL) as req:
                np.copyto(req.inputs["x"], x)
                fut = req.submit()
            return await fut

        async def chain() -> None:
            while (now := time.perf_counter()) < t_end:
                await one()
                if t_count <= now and time.perf_counter() < t_end:
                    counted[0] += 1

        await asyncio.gather(*(chain() for _ in range(spec["in_flight"])))
    return {"completed": counted[0], "errors": 0, "error_codes": {}}


def async_client(spec: dict[str, Any], sync: Sync) -> Figures:
    """One process, ``in_flight`` tasks, each awaiting ``AsyncClient.infer`` in a loop (uvloop when present).
    Its set-up (session, warm-up) runs inside the window's loop, so it syncs before it starts."""
    sync()
    try:
        import uvloop

        return uvloop.run(_async_window(spec))
    except ImportError:
        return asyncio.run(_async_window(spec))


def _window(progress: Progress, runtime_dir: Path, api: str, processes: int, in_flight: int,
            duration_s: float) -> float:
    """Answers per second of one API, all its processes together."""
    n = 1 if api.startswith("async") else processes
    base = {"runtime_dir": str(runtime_dir), "model": MODEL, "warmup_s": 0.5, "duration_s": duration_s,
            "warmup_requests": 20, "zero": api.endswith("zero")}
    target = {"call": throughput_client, "submit": submit_client, "async": async_client, "zero": zero_client,
              "async_zero": async_client, "infer": infer_client}[api]
    specs = [{**base, "index": i, "seed": i, "in_flight": in_flight // n} for i in range(n)]
    results = run_group(progress, target, specs, 0.5 + duration_s)
    errors = sum(r["errors"] for r in results)
    if errors:
        raise SystemExit(f"{api}: {errors} requests failed: {[r['error_codes'] for r in results]}")
    return round(float(sum(r["completed"] for r in results)) / duration_s, 1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m shmbroker.bench.apis", description=__doc__)
    ap.add_argument("--config", default=None, metavar="PATH", help="broker config (default configs/default.toml)")
    ap.add_argument("--processes", type=int, default=4, help="processes of the call and submit windows")
    ap.add_argument("--in-flight", type=int, default=32, help="requests in flight in all (default 32)")
    ap.add_argument("--duration", type=float, default=3.0, metavar="SECONDS", help="each window")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the three windows")
    ap.add_argument("--out", default=None, metavar="FILE", help="write the JSON document to FILE")
    args = ap.parse_args(argv)
    progress = Progress()
    cfg = Path(args.config) if args.config else Path(__file__).resolve().parent.parent / "configs" / "default.toml"
    rounds: list[Figures] = []
    with tempfile.TemporaryDirectory(prefix="shmbroker-bench-apis-") as tmp, \
            BrokerProcess(cfg, Path(tmp), progress) as b:
        for r in range(args.rounds):
            progress.phase(f"round {r + 1} of {args.rounds}")
            f: Figures = {f"{api}_per_s": _window(progress, b.runtime_dir, api, args.processes, args.in_flight,
                                                  args.duration) for api in APIS}
            f["submit_over_call"] = round(f["submit_per_s"] / f["call_per_s"], 3)
            f["async_over_call"] = round(f["async_per_s"] / f["call_per_s"], 3)
            f["zero_over_call"] = round(f["zero_per_s"] / f["call_per_s"], 3)  # information
            f["async_zero_over_async"] = round(f["async_zero_per_s"] / f["async_per_s"], 3)  # information
            f["infer_over_call"] = round(f["infer_per_s"] / f["call_per_s"], 3)  # information
            progress.done(json.dumps(f))
            rounds.append(f)
    targets = {k: {"value": statistics.median(f[k] for f in rounds), "op": ">=", "target": TARGET}
               for k in ("submit_over_call", "async_over_call")}
    for t in targets.values():
        t["pass"] = t["value"] >= TARGET
    doc = {"schema": "shmbroker-bench-apis/1", "machine": report.machine(), "config": str(cfg),
           "settings": vars(args), "rounds": rounds, "targets": targets}
    emit(doc, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
