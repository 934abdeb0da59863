"""``python -m shmbroker.bench.gpu_lone``: one request at a time on the GPU, through the broker and in-process on
the same engine, in interleaved rounds. A lone p50 moves by about 0.1 ms between runs of one build on one
machine (bench/RESULTS.md#on-the-h100-one-stream-slot-for-lone-requests-one-spinning-thread), so each round
measures both sides back to back and the target is judged on the median of the rounds.

A round: (a) batch 1 back to back on one stream (ms a batch), then one request at a time with its copies from
page-locked memory (``lone``, as bench.gpu's (a)); (c) one client of this process with one request in flight
through the bench's broker for ``--window`` seconds, with ``--api`` (as bench.gpu's (c)). The target: the
median over the rounds of (c)'s p50 minus (a)'s batch-1 time is at most LONE_SLACK_MS. JSON on stdout
(``--out`` for a file), progress and a table on stderr.
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from shmbroker.bench import gpu_inprocess, gpu_load, gpu_variants, report
from shmbroker.bench.broker_proc import BrokerProcess
from shmbroker.bench.common import Figures, Progress, emit, latency_summary
from shmbroker.bench.gpu import DEFAULT_CONFIG, ENGINES, MODEL
from shmbroker.bench.gpu_report import LONE_SLACK_MS
from shmbroker.broker.common import config
from shmbroker.client import Client

BATCH1_RUNS = 200
WARMUP_S = 0.2


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--config", default=None, metavar="PATH", help="broker config (default bench/gpu.toml)")
    ap.add_argument("--engine", choices=ENGINES, default="torch", help="the engine of both sides (default torch)")
    ap.add_argument("--inductor", default="", metavar="PACKAGE", help="--engine inductor: the package")
    ap.add_argument("--max-batch", type=int, default=256, metavar="N", help="the model's max_batch (default 256)")
    ap.add_argument("--streams", type=int, default=4, metavar="N", help="the model's stream slots (default 4)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="model_options",
                    help="a key of the model's section, or SECTION.KEY of another (repeatable)")
    ap.add_argument("--api", choices=tuple(gpu_load.API_LOOPS), default="infer",
                    help="(c): Client.infer in a loop (default), Client.call chains, or zero-copy requests")
    ap.add_argument("--client-spin-us", type=int, default=1000, metavar="US", help="the client's spin_us")
    ap.add_argument("--rounds", type=int, default=5, metavar="N", help="interleaved rounds (default 5)")
    ap.add_argument("--window", type=float, default=1.0, metavar="SECONDS", help="(c) in each round (default 1)")
    ap.add_argument("--out", default=None, metavar="FILE", help="write the JSON document to FILE too")


def summary(rounds: list[Figures]) -> Figures:
    """The medians over ``rounds`` (each with ``batch1_ms``, ``lone_ms`` and ``broker_p50_ms``) and the target:
    the median of (c)'s p50 minus (a)'s batch-1 time, at most LONE_SLACK_MS."""
    if not rounds:
        raise ValueError("no rounds: --rounds must be at least 1")
    over = [r["broker_p50_ms"] - r["batch1_ms"] for r in rounds]
    over_lone = [r["broker_p50_ms"] - r["lone_ms"] for r in rounds]
    median_over = statistics.median(over)
    return {
        "batch1_ms": round(statistics.median(r["batch1_ms"] for r in rounds), 4),
        "lone_ms": round(statistics.median(r["lone_ms"] for r in rounds), 4),
        "broker_p50_ms": round(statistics.median(r["broker_p50_ms"] for r in rounds), 4),
        "over_batch1_ms": round(median_over, 4), "over_lone_ms": round(statistics.median(over_lone), 4),
        "over_batch1_range_ms": [round(min(over), 4), round(max(over), 4)],
        "target": {"value": round(median_over, 4), "op": "<=", "target": LONE_SLACK_MS,
                   "pass": median_over <= LONE_SLACK_MS,
                   "what": "median over rounds of (c)'s p50 minus (a)'s batch-1 time, ms"},
    }


class InProcess:
    """(a): the engine in this process, one stream and one context for batch 1."""

    def __init__(self, cfg: config.Config, device: int) -> None:
        from shmbroker.gpu_worker import cuda

        cuda.set_device(device)
        self.engine = gpu_inprocess.load_device_engine(cfg, MODEL, device)
        self.stream = cuda.Stream()
        self.ctx = self.engine.create_context(0, self.stream.handle, 1, sizes=[1])
        self.start, self.end = cuda.Event(timing=True), cuda.Event(timing=True)

    def batch1_ms(self, runs: int = BATCH1_RUNS) -> float:
        return gpu_inprocess.back_to_back_ms(self.ctx, self.stream, self.start, self.end, 1, runs) / runs

    def lone_ms(self) -> float:
        return float(gpu_inprocess.lone_request(self.engine, self.ctx, self.stream, self.end)["p50_ms"])

    def close(self) -> None:
        self.ctx.close()
        self.stream.close()
        self.engine.close()


def through_broker(client: Client, api: str, x: np.ndarray, window_s: float, model: str = MODEL) -> Figures:
    """(c): one request in flight for ``window_s`` after a short warm-up; the latency of those in the window."""
    t0 = time.perf_counter()
    loop = gpu_load.API_LOOPS[api](client, model, x, t0 + WARMUP_S, t0 + WARMUP_S + window_s, 1)
    if not loop.run(WARMUP_S + window_s + 30.0):
        raise RuntimeError(f"(c) with --api {api}: a request was still unanswered 30 s after the window")
    errors = dict(loop.errors)
    if errors or not loop.samples:
        raise RuntimeError(f"(c) with --api {api}: {len(loop.samples)} answers in the window, failures {errors}")
    return latency_summary(loop.samples)


def run_rounds(args: argparse.Namespace, cfg: config.Config, workdir: Path, progress: Progress) -> list[Figures]:
    device = int(cfg.worker.devices[0])
    options = gpu_variants.parse_options(args.model_options)
    variant = gpu_variants.engine_config(cfg, MODEL, args.engine, args.inductor, args.max_batch, args.streams,
                                         options)
    path = gpu_variants.write(variant, workdir / f"{args.engine}.toml")
    progress.phase(f"(a) {args.engine} in-process")
    a = InProcess(variant, device)
    rounds: list[Figures] = []
    try:
        x = np.random.default_rng(0).random((1, *a.engine.inputs[0].item_shape), dtype=np.float32)
        progress.phase("(c) the broker")
        with BrokerProcess(path, workdir, progress) as b, \
                Client(b.runtime_dir, slots=2, name="bench-gpu-lone", spin_us=args.client_spin_us) as client:
            progress.note(f"broker ready in {b.startup_s:.1f} s")
            for i in range(args.rounds):
                r = {"batch1_ms": round(a.batch1_ms(), 4), "lone_ms": a.lone_ms()}
                c = through_broker(client, args.api, x, args.window)
                r.update(broker_p50_ms=round(c["p50_us"] / 1e3, 4), broker_p99_ms=round(c["p99_us"] / 1e3, 4),
                         broker_samples=c["samples"])
                progress.tick(f"round {i + 1}/{args.rounds}: batch 1 {r['batch1_ms']:.3f} ms, lone "
                              f"{r['lone_ms']:.3f} ms, broker p50 {r['broker_p50_ms']:.3f} ms")
                rounds.append(r)
    finally:
        a.close()
    return rounds


def table(rounds: list[Figures], s: Figures) -> str:
    lines = ["round  batch1 ms  lone ms  broker p50  broker p99  over batch1"]
    for i, r in enumerate(rounds, 1):
        lines.append(f"{i:>5}  {r['batch1_ms']:>9.3f}  {r['lone_ms']:>7.3f}  {r['broker_p50_ms']:>10.3f}  "
                     f"{r['broker_p99_ms']:>10.3f}  {r['broker_p50_ms'] - r['batch1_ms']:>11.3f}")
    t = s["target"]
    lines.append(f"median {s['batch1_ms']:>8.3f}  {s['lone_ms']:>7.3f}  {s['broker_p50_ms']:>10.3f}  "
                 f"{'':>10}  {s['over_batch1_ms']:>11.3f}   target <= {t['target']}: "
                 f"{'PASS' if t['pass'] else 'FAIL'}")
    return "\n".join(lines) + "\n"


def main(args: argparse.Namespace) -> int:
    if args.rounds < 1 or args.window <= 0:
        raise SystemExit(f"--rounds ({args.rounds}) must be at least 1 and --window ({args.window}) above 0")
    progress = Progress()
    cfg_path = Path(args.config).resolve() if args.config else DEFAULT_CONFIG
    cfg = config.load(cfg_path)
    if MODEL not in cfg.models or cfg.worker.devices[0] == "cpu":
        raise SystemExit(f"{cfg_path}: the GPU bench needs a model {MODEL!r} and a GPU in worker.devices")
    with tempfile.TemporaryDirectory(prefix="shmbroker-bench-gpu-lone-") as tmp:
        try:
            rounds = run_rounds(args, cfg, Path(tmp), progress)
        except config.ConfigError as exc:
            raise SystemExit(str(exc)) from None
    s = summary(rounds)
    from shmbroker.gpu_worker import cuda

    settings: dict[str, Any] = {k: v for k, v in vars(args).items() if k != "out"}
    machine = {**report.machine(), "gpu": cuda.device_name(int(cfg.worker.devices[0]))}
    doc: Figures = {"schema": "shmbroker-bench-gpu-lone/1",
                    "date": dt.datetime.now(dt.UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z"),
                    "machine": machine, "config": str(cfg_path), "settings": settings,
                    "rounds": rounds, "summary": s, "elapsed_s": round(progress.elapsed(), 1)}
    sys.stderr.write(table(rounds, s))
    emit(doc, args.out)
    return 0 if s["target"]["pass"] else 1


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="python -m shmbroker.bench.gpu_lone", description=__doc__)
    add_arguments(ap)
    sys.exit(main(ap.parse_args()))
