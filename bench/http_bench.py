"""``shmbroker bench --http``: the HTTP front-end against the Python ring client, on one broker, in one run.

For each model (``tiny``, then ``nsfw``): the ring client (bench/sweep.py's machinery at 16 in flight over
4 processes, every request timed), then the same load through the HTTP front-end (``shmbroker http
--workers N``, binary tensor data, 4 load processes x 4 requests in flight on keep-alive connections), then
the ring client again; the ring figure is the mean of the two, so a drift of the machine cancels out of
the ratio. Latency is per request, from just before the request is sent to its answer, over the requests
answered inside the window. The HTTP load runs on aiohttp + uvloop, the leanest Python HTTP client at hand:
the load generator shares the machine's cores with the front-end, the broker and the engine.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from shmbroker.bench import sweep
from shmbroker.bench.broker_proc import BrokerProcess
from shmbroker.bench.common import BenchError, Figures, Progress
from shmbroker.bench.procs import Sync, run_group
from shmbroker.broker.common import config

CONCURRENCY = 16
MODELS = ("tiny", "nsfw")
NSFW_TARGET = 0.8  # HTTP throughput / ring client throughput for nsfw


def _body(meta: dict[str, Any], seed: int) -> tuple[bytes, dict[str, str]]:
    """A one-row binary-data infer request of random inputs for the model ``meta`` describes."""
    from shmbroker.frontend.kserve import NUMPY_OF

    rng = np.random.default_rng(seed)
    entries, chunks = [], []
    for t in meta["inputs"]:
        shape = [1, *t["shape"][1:]]
        x = rng.random(shape, dtype=np.float32).astype(NUMPY_OF[t["datatype"]])
        entries.append({"name": t["name"], "datatype": t["datatype"], "shape": shape,
                        "parameters": {"binary_data_size": x.nbytes}})
        chunks.append(x.tobytes())
    header = json.dumps({"inputs": entries, "parameters": {"binary_data_output": True}}).encode()
    return header + b"".join(chunks), {"Inference-Header-Content-Length": str(len(header)),
                                       "Content-Type": "application/octet-stream"}


async def _load(spec: dict[str, Any], sync: Sync) -> Figures:
    import aiohttp

    url, model, in_flight = spec["url"], spec["model"], spec["in_flight"]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=in_flight)) as s:
        async with s.get(f"{url}/v2/models/{model}") as r:
            if r.status != 200:
                raise BenchError(f"GET /v2/models/{model}: HTTP {r.status}: {await r.text()}")
            body, headers = _body(await r.json(), spec["seed"])
        infer = f"{url}/v2/models/{model}/infer"
        for _ in range(spec["warmup_requests"]):
            async with s.post(infer, data=body, headers=headers) as r:
                if r.status != 200:
                    raise BenchError(f"warm-up infer {model}: HTTP {r.status}: {await r.text()}")
                await r.read()
        await asyncio.get_running_loop().run_in_executor(None, sync)
        clock = time.perf_counter_ns
        count_ns = clock() + int(spec["warmup_s"] * 1e9)
        end_ns = count_ns + int(spec["duration_s"] * 1e9)
        samples: list[int] = []
        errors: collections.Counter[str] = collections.Counter()

        async def chain() -> None:
            while (t0 := clock()) < end_ns:
                async with s.post(infer, data=body, headers=headers) as r:
                    await r.read()
                    status = r.status
                t1 = clock()
                if count_ns <= t1 < end_ns:
                    if status == 200:
                        samples.append(t1 - t0)
                    else:
                        errors[f"HTTP {status}"] += 1

        await asyncio.gather(*(chain() for _ in range(in_flight)))
    return {"completed": len(samples), "errors": sum(errors.values()), "error_codes": dict(errors),
            "window_s": spec["duration_s"], "latency_ns": np.asarray(samples, dtype=np.int64)}


def http_client(spec: dict[str, Any], sync: Sync) -> Figures:
    """A load process: ``in_flight`` chains of binary-data infer requests, each on its keep-alive connection."""
    import uvloop

    return uvloop.run(_load(spec, sync))


class Frontend:
    """``shmbroker http --port 0`` for the bench's broker; ``url`` once every process is ready. ``slots``: each
    front-end process's session, the requests it holds in flight at most; ``extra``: more of its options."""

    def __init__(self, runtime_dir: Path, workers: int, log_path: Path, slots: int = 2 * CONCURRENCY,
                 extra: Sequence[str] = ()) -> None:
        env = dict(os.environ, SHMBROKER_RUNTIME_DIR=str(runtime_dir), PYTHONUNBUFFERED="1")
        cmd = [sys.executable, "-m", "shmbroker.broker.cli", "--runtime-dir", str(runtime_dir), "http", "--workers",
               str(workers), "--port", "0", "--slots", str(slots), "--max-items", "1", *extra]
        self.log_path = log_path
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=log, text=True)
        line = self.proc.stdout.readline() if self.proc.stdout is not None else ""  # the ready line, or EOF
        m = re.search(r"ready on (http://\S+)", line)
        if m is None:
            self.stop()
            raise BenchError(f"shmbroker http did not start; its log ends:\n{log_path.read_text()[-3000:]}")
        self.url = m.group(1)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        return self.proc.wait(60)


def _point(progress: Progress, label: str, f: Figures) -> Figures:
    lat = f["latency"]
    if not lat.get("samples"):
        raise BenchError(f"{label}: no request completed inside the window")
    progress.note(f"{label}: {f['per_s']:,.1f}/s, p50 {lat['p50_us']:,.0f} us, p99 {lat['p99_us']:,.0f} us, "
                  f"{f['errors']} errors")
    return f


def ring_point(progress: Progress, runtime_dir: Path, model: str, window_s: float, warmup_s: float) -> Figures:
    plan = sweep.Plan(model, (CONCURRENCY,), warmup_s=warmup_s, warmup_requests=2)
    f = sweep.sweep(progress, str(runtime_dir), plan, window_s)["points"][0]
    return _point(progress, f"{model} ring client", f)


def http_point(progress: Progress, url: str, model: str, window_s: float, warmup_s: float) -> Figures:
    in_flight = sweep.split(CONCURRENCY)
    specs = [{"url": url, "model": model, "in_flight": n, "seed": 3000 + i, "warmup_requests": 2,
              "warmup_s": warmup_s, "duration_s": window_s} for i, n in enumerate(in_flight)]
    parts = run_group(progress, http_client, specs, expect_s=warmup_s + window_s)
    return _point(progress, f"{model} HTTP", sweep._merge(CONCURRENCY, in_flight, window_s, parts))


def compare(progress: Progress, runtime_dir: Path, url: str, model: str, window_s: float) -> Figures:
    """Ring, HTTP, ring again for one model; ``http_over_ring`` is HTTP over the mean of the two ring runs."""
    warmup_s = 1.0
    ring1 = ring_point(progress, runtime_dir, model, window_s, warmup_s)
    http = http_point(progress, url, model, window_s, warmup_s)
    ring2 = ring_point(progress, runtime_dir, model, window_s, warmup_s)
    ring_per_s = (ring1["per_s"] + ring2["per_s"]) / 2
    return {"ring": ring1, "http": http, "ring_again": ring2, "ring_per_s_mean": round(ring_per_s, 1),
            "http_over_ring": round(http["per_s"] / ring_per_s, 3)}


def table(doc: Figures) -> str:
    lines = [f"HTTP front-end ({doc['http_workers']} processes, binary data) vs ring client, "
             f"{CONCURRENCY} in flight", f"{'model':<6} {'client':<12} {'per s':>10} {'p50 us':>10} {'p99 us':>10}"
             f" {'errors':>7}", "-" * 60]
    for model, f in doc["models"].items():
        for key in ("ring", "http", "ring_again"):
            p = f[key]
            lines.append(f"{model:<6} {key:<12} {p['per_s']:>10,.1f} {p['latency']['p50_us']:>10,.0f} "
                         f"{p['latency']['p99_us']:>10,.0f} {p['errors']:>7}")
        lines.append(f"{model:<6} HTTP / ring = {f['http_over_ring']:.3f}"
                     + (f" (target >= {NSFW_TARGET}: {'met' if f['http_over_ring'] >= NSFW_TARGET else 'MISSED'})"
                        if model == "nsfw" else ""))
    return "\n".join(lines) + "\n"


def main(args: argparse.Namespace) -> int:
    from shmbroker.bench.report import machine

    progress = Progress()
    cfg_path = Path(args.config).resolve() if args.config else config.DEFAULT_CONFIG
    window_s = args.duration if args.duration is not None else (2.0 if args.quick else 5.0)
    doc: Figures = {"schema": "shmbroker-bench-http/1", "machine": machine(), "config": str(cfg_path),
                    "http_workers": args.http_workers, "concurrency": CONCURRENCY, "window_s": window_s,
                    "models": {}}
    doc["date"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    workdir = Path(tempfile.mkdtemp(prefix="shmbroker-bench-http-"))
    with BrokerProcess(cfg_path, workdir, progress) as broker:
        progress.phase(f"starting shmbroker http --workers {args.http_workers}")
        front = Frontend(broker.runtime_dir, args.http_workers, workdir / "http.log")
        try:
            for model in MODELS:
                scale = 2.0 if model == "nsfw" else 1.0  # nsfw runs tens of images/s: a longer window for a p99
                progress.phase(f"{model}: ring client, HTTP, ring client again; {window_s * scale:g} s windows")
                doc["models"][model] = compare(progress, broker.runtime_dir, front.url, model, window_s * scale)
        finally:
            doc["http_exit_code"] = front.stop()
    text = table(doc)
    sys.stdout.write(text)
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
        progress.note(f"wrote {args.out}")
    return 0 if doc["http_exit_code"] == 0 else 1
