"""``python -m shmbroker.bench.lone``: a lone request (concurrency 1) through the broker, with idle dispatch on and off,
against the engine in-process at batch 1 with 1 and 2 threads, all in one run, in interleaved rounds.

The broker runs the config (default ``configs/default.toml``) with ``models.MODEL.batching`` set to "idle"
and to "triton"; one client calls ``infer`` ``--requests`` times in a row after a warm-up. JSON on stdout
(``--out`` for a file), progress on stderr. The target: the broker's p50 with idle dispatch at most 1.25 x
the better in-process p50. Figures: bench/RESULTS.md#idle-dispatch.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnxruntime as ort

from shmbroker.bench import gpu_variants, report
from shmbroker.bench.broker_proc import BrokerProcess
from shmbroker.bench.common import Figures, Progress, emit
from shmbroker.broker.common import config
from shmbroker.client import Client
from shmbroker.gpu_worker import model_source

TARGET = 1.25


def _p50_ms(run: Callable[[], object], requests: int, warmup: int = 5) -> float:
    for _ in range(warmup):
        run()
    times = []
    for _ in range(requests):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return round(statistics.median(times) * 1e3, 3)


def in_process(path: str | bytes, threads: int, x: np.ndarray, requests: int) -> float:
    """p50 of ONNX Runtime on the CPU at batch 1 with ``threads`` intra-op threads."""
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    sess = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
    name = sess.get_inputs()[0].name
    return _p50_ms(lambda: sess.run(None, {name: x}), requests)


def through_broker(cfg: config.Config, model: str, idle: bool, x: np.ndarray, requests: int, workdir: Path,
                   progress: Progress) -> float:
    """p50 of ``Client.infer`` on a broker whose ``model`` batches by idle dispatch (``idle``) or Triton's rule."""
    data = config.to_dict(cfg)
    data.pop("source", None)
    data["models"][model]["batching"] = "idle" if idle else "triton"  # type: ignore[index]
    data["models"][model]["path"] = cfg.model_path(model)  # type: ignore[index]
    variant = config.parse(data, cfg.source)
    run_dir = workdir / f"idle-{idle}"
    run_dir.mkdir()
    with BrokerProcess(gpu_variants.write(variant, run_dir / "broker.toml"), run_dir, progress) as b, \
            Client(b.runtime_dir) as c:
        return _p50_ms(lambda: c.infer(model, x), requests)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m shmbroker.bench.lone", description=__doc__)
    ap.add_argument("--config", default=None, metavar="PATH", help="broker config (default configs/default.toml)")
    ap.add_argument("--model", default="nsfw")
    ap.add_argument("--requests", type=int, default=60, help="timed requests per measurement (default 60)")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds of the four measurements")
    ap.add_argument("--out", default=None, metavar="FILE", help="write the JSON document to FILE")
    args = ap.parse_args(argv)
    progress = Progress()
    cfg = config.load(args.config)
    if args.model not in cfg.models or cfg.models[args.model].engine != "onnxruntime":
        raise SystemExit(f"--model {args.model}: the config must serve it on engine 'onnxruntime'")
    path = model_source.resolve(cfg.model_path(args.model))
    shape = [1, *ort.InferenceSession(path, providers=["CPUExecutionProvider"]).get_inputs()[0].shape[1:]]
    x = np.random.default_rng(1).random(shape, dtype=np.float32)
    rounds: list[Figures] = []
    with tempfile.TemporaryDirectory(prefix="shmbroker-bench-lone-") as tmp:
        for r in range(args.rounds):
            progress.phase(f"round {r + 1} of {args.rounds}")
            f: Figures = {f"in_process_{t}_threads_ms": in_process(path, t, x, args.requests) for t in (1, 2)}
            for idle in (True, False):
                workdir = Path(tmp) / f"r{r}"
                workdir.mkdir(exist_ok=True)
                f[f"broker_idle_dispatch_{'on' if idle else 'off'}_ms"] = through_broker(
                    cfg, args.model, idle, x, args.requests, workdir, progress)
            best = min(f["in_process_1_threads_ms"], f["in_process_2_threads_ms"])
            f["idle_on_over_best_in_process"] = round(f["broker_idle_dispatch_on_ms"] / best, 3)
            progress.done(json.dumps(f))
            rounds.append(f)
    ratio = statistics.median(f["idle_on_over_best_in_process"] for f in rounds)
    doc = {"schema": "shmbroker-bench-lone/1", "machine": report.machine(), "model": args.model,
           "config": cfg.source, "requests": args.requests, "rounds": rounds,
           "target": {"value": ratio, "op": "<=", "target": TARGET, "pass": ratio <= TARGET,
                      "what": "median over rounds: broker p50 with idle dispatch over the better in-process p50"}}
    emit(doc, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
