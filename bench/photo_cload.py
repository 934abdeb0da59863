"""(b') of the photo bench with examples/c's client instead of Python's: ``processes`` copies of ``shmb_client
--load SECONDS SLOTS MODEL FILE...``, each keeping every slot of its session busy with the photo set's files, one
photo a request, and printing one JSON line (its requests, photos/s, its own CPU a request from getrusage,
latencies). What the protocol itself costs a client, next to the Python client's (b)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
from pathlib import Path

from shmbroker.bench.common import BenchError, Figures

WARMUP_S = 1.0  # shmb_client --load runs this long, uncounted, before its window


def check_binary(path: str) -> str:
    """``path`` as given, if it is an executable file; BenchError naming --c-client otherwise."""
    if not (Path(path).is_file() and os.access(path, os.X_OK)):
        raise BenchError(f"--c-client {path}: not an executable file (build it: make -C examples/c OUT=DIR)")
    return path


def command(binary: str, duration_s: float, slots: int, model: str, paths: list[str]) -> list[str]:
    return [binary, "--load", f"{duration_s:g}", str(slots), model, *paths]


def merge(results: list[Figures]) -> Figures:
    """The processes' lines as one window: photos/s and requests summed, client CPU a photo weighted by requests,
    p50 the processes' median, p99 their largest."""
    requests = sum(int(r["requests"]) for r in results)
    if requests == 0:
        raise BenchError("the C clients counted no request in their windows")
    cpu = sum(float(r["cpu_us_per_request"]) * int(r["requests"]) for r in results) / requests
    return {"per_s": round(sum(float(r["per_s"]) for r in results), 1), "requests": requests,
            "errors": sum(int(r["errors"]) for r in results), "client_cpu_us_per_request": round(cpu, 2),
            "latency": {"p50_us": statistics.median(int(r["p50_us"]) for r in results),
                        "p99_us": max(int(r["p99_us"]) for r in results)},
            "processes": len(results), "slots_per_process": int(results[0]["slots"])}


def run(binary: str, runtime_dir: Path, model: str, paths: list[str], processes: int, slots: int,
        duration_s: float) -> Figures:
    """One window of ``processes`` C clients; ``window_monotonic`` is their counted window as this process's
    clock places it (from their start, the warm-up after).

    Raises:
        BenchError: a client failed (its exit status and last words) or printed no JSON line.
    """
    env = dict(os.environ, SHMBROKER_RUNTIME_DIR=str(runtime_dir))
    t0 = time.monotonic()
    procs = [subprocess.Popen(command(binary, duration_s, slots, model, paths), env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(processes)]
    results: list[Figures] = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=duration_s + WARMUP_S + 60.0)
            lines = out.strip().splitlines()
            if p.returncode not in (0, 3) or not lines:
                raise BenchError(f"shmb_client --load exited {p.returncode}: {err.strip()[-300:]}")
            results.append(json.loads(lines[-1]))
    except subprocess.TimeoutExpired as exc:
        raise BenchError(f"shmb_client --load did not finish within {exc.timeout:g} s") from None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    figures = merge(results)
    figures["window_monotonic"] = (t0 + WARMUP_S, t0 + WARMUP_S + duration_s)
    return figures
