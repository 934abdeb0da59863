"""``python -m shmbroker.bench.peers.run``: shmbroker and the servers a user would pick instead, one after another
on one machine, on the same engine, under the same load generator; a JSON document and the markdown table.

In order: the in-process figures (each input row's reference answer, the engine through one instance as the
peers run it, and on a GPU the device-only limit of bench.gpu's (a)); then each server of ``--peers``: started,
measured at concurrency 1 (one process, one request in flight) and at each ``--in-flight`` depth from
``--processes`` processes (the depth of the most answers/s is its saturation point), stopped. A server that
cannot start, or whose packages are missing, is recorded as failed and the run goes on; the exit status is then 1.
bench/README.md, "Peers", says what each server runs and how to run this on the GPU machine.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shmbroker.bench import gpu_variants
from shmbroker.bench.broker_proc import BrokerProcess
from shmbroker.bench.common import BenchError, Figures, Progress
from shmbroker.bench.peers import answers, load, stats, table
from shmbroker.bench.peers import engine as E
from shmbroker.bench.peers.servers import Sampler, ServerProcess, free_port, gpu_name
from shmbroker.bench.procs import run_group
from shmbroker.broker.common import config
from shmbroker.broker.common.engines import gpu_engines

SCHEMA = "shmbroker-bench-peers/1"
PEERS = ("shmbroker", "pytriton", "litserve", "fastapi")
LABELS = {"shmbroker": "shmbroker", "pytriton": "PyTriton", "litserve": "LitServe",
          "fastapi": "FastAPI + asyncio batcher"}
NEEDS = {  # modules a peer's server and clients import, and what to install for them
    "shmbroker": (("zmq", "aiohttp", "uvloop"), "shmbroker[serve,http]"),
    "pytriton": (("pytriton", "tritonclient.grpc", "aiohttp", "uvloop"), "nvidia-pytriton 'tritonclient[grpc]'"),
    "litserve": (("litserve", "fastapi", "uvicorn", "aiohttp", "uvloop"), "litserve fastapi uvicorn"),
    "fastapi": (("fastapi", "uvicorn", "httptools", "aiohttp", "uvloop"), "fastapi uvicorn httptools"),
}
GPU_CONFIG = Path(__file__).resolve().parent.parent / "gpu.toml"


@dataclass
class Setup:
    """What every measurement shares: the config file, the model, its reference answers, the load's shape."""

    config_path: Path
    model: str
    info: E.ModelInfo
    rows: Any
    reference: Any
    tolerance: float
    processes: int
    depths: list[int]
    duration_s: float
    warmup_s: float
    c1_duration_s: float
    gpu: int | None
    workdir: Path
    failures: list[str] = field(default_factory=list)


def missing_modules(peer: str) -> list[str]:
    out = []
    for name in NEEDS[peer][0]:
        try:
            found = importlib.util.find_spec(name) is not None
        except ImportError:  # a parent package missing
            found = False
        if not found:
            out.append(name)
    return out


def python_library_env() -> dict[str, str]:
    """The environment in which Triton's Python backend stub finds this interpreter's own ``libpython3.X.so``
    (it links the library by name; another Python's of the same version breaks it); BenchError when there is
    none to find (a static build with no library beside it), which PyTriton cannot serve from."""
    import ctypes.util
    import os
    import sysconfig

    libdir, name = str(sysconfig.get_config_var("LIBDIR") or ""), str(sysconfig.get_config_var("INSTSONAME") or "")
    if name and (Path(libdir) / name).is_file():
        return {"LD_LIBRARY_PATH": os.pathsep.join(p for p in (libdir, os.environ.get("LD_LIBRARY_PATH", "")) if p)}
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    if ctypes.util.find_library(f"python{version}"):
        return {}  # on the loader's own path
    raise BenchError(f"no libpython{version}.so for {sys.executable} (a static build?): Triton's Python backend "
                     "stub links it, so PyTriton cannot run here")


def pytriton_python(workdir: Path) -> str:
    """The interpreter the PyTriton server runs on: this one, from a virtual environment made for it.

    PyTriton finds Triton's libraries beside its package only when the package is in a site-packages folder of
    the running Python (elsewhere it takes itself for an editable install), and Triton's Python backend stub
    ignores PYTHONPATH: it imports numpy and pyzmq from the prefix of the first ``python`` on PATH, which PyTriton
    sets to the server's own. So the server runs from a venv made here, with no PYTHONPATH: PyTriton and its
    libraries linked into the venv's site-packages, and a ``peers.pth`` there listing ``PEERS_PYTRITON_NUMPY``
    (a folder holding numpy 1, which PyTriton 0.7 needs) and then every folder this process imports from.
    """
    import importlib.util
    import os
    import platform

    spec = importlib.util.find_spec("pytriton")
    if spec is None or spec.origin is None:
        raise BenchError("pytriton is not importable (pip install nvidia-pytriton)")
    package = Path(spec.origin).resolve().parent
    venv = workdir / "pytriton-venv"
    base = Path(getattr(sys, "_base_executable", "") or sys.executable)
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    site_packages = venv / "lib" / version / "site-packages"
    site_packages.mkdir(parents=True)
    (venv / "bin").mkdir()
    (venv / "pyvenv.cfg").write_text(f"home = {base.parent}\ninclude-system-site-packages = false\n"
                                     f"version = {platform.python_version()}\n")
    for name in ("python", "python3", version):
        (venv / "bin" / name).symlink_to(base)
    for linked in (package, package.parent / "nvidia_pytriton.libs"):
        if linked.is_dir():
            (site_packages / linked.name).symlink_to(linked)
    paths = [os.environ.get("PEERS_PYTRITON_NUMPY", ""), *(str(Path(p).resolve()) for p in sys.path if p)]
    (site_packages / "peers.pth").write_text("\n".join(p for p in paths if p and Path(p).is_dir()) + "\n")
    return str(venv / "bin" / "python")


def write_config(args: argparse.Namespace, workdir: Path) -> Path:
    """The config every server reads: ``--config`` (or the GPU bench's, with ``--engine`` on a GPU) with only
    ``--model``, on ``--engine`` with ``--max-batch``/``--streams``/``--set`` applied."""
    base = Path(args.config) if args.config else (GPU_CONFIG if args.engine in gpu_engines() else None)
    cfg = config.load(base)
    if args.model not in cfg.models:
        raise config.ConfigError(f"{cfg.source}: no [models.{args.model}] (--model); it has {sorted(cfg.models)}")
    engine = args.engine or cfg.models[args.model].engine
    options = gpu_variants.parse_options(args.set)
    merged = gpu_variants.engine_config(cfg, args.model, engine, package=args.package, max_batch=args.max_batch,
                                        streams=args.streams, options=options)
    return gpu_variants.write(merged, workdir / "config.toml")


def inprocess(progress: Progress, setup_cfg: Path, model: str, n_rows: int, limit_s: float
              ) -> tuple[E.ModelInfo, Any, Any, Figures]:
    """Reference answers and the in-process figures; the engine is closed before any server starts."""
    cfg = config.load(setup_cfg)
    progress.phase("in-process: the reference answers and the engine's limit")
    engine = E.load(cfg, model)
    mi = E.info(cfg, model, engine)
    r = E.runner(engine, 0, mi.max_batch)
    try:
        rows = E.inputs(mi, n_rows, seed=2024)
        reference = E.reference(r, rows)
        answers.pair(rows, reference)
        sizes = sorted({1, min(8, mi.max_batch), min(32, mi.max_batch), mi.max_batch})
        runner_limit = E.runner_limit(r, mi, sizes, limit_s)
    finally:
        r.close()
        engine.close()
    progress.done(f"{runner_limit['items_per_s']:,.0f} images/s at batch {runner_limit['best_batch']} through one "
                  "instance")
    figures: Figures = {"runner_limit": runner_limit}
    if mi.device != "cpu":
        from shmbroker.bench import gpu_inprocess

        progress.phase("in-process: the device-only limit (bench.gpu's (a))")
        try:
            figures["device_limit"] = gpu_inprocess.limit(cfg, model, int(mi.device), limit_s, progress)
            progress.done(f"{figures['device_limit']['items_per_s']:,.0f} images/s")
        except Exception as exc:  # noqa: BLE001 - a figure of the table: recorded as failed, the run goes on
            figures["device_limit"] = {"error": f"{type(exc).__name__}: {exc}"}
    return mi, rows, reference, figures


def measure(progress: Progress, s: Setup, base: dict[str, Any], processes: int, in_flight: int, duration_s: float,
            roots: list[int]) -> Figures:
    specs = [dict(base, index=i, in_flight=in_flight, warmup_s=s.warmup_s, duration_s=duration_s,
                  warmup_requests=2, rows=s.rows, reference=s.reference, tolerance=s.tolerance,
                  model_info=s.info.as_dict(), model=s.model) for i in range(processes)]
    sampler = Sampler(roots, s.gpu)
    sampler.start()
    sampler.first.wait(10.0)
    try:
        parts = run_group(progress, load.client, specs, expect_s=s.warmup_s + duration_s)
    finally:
        sampler.stop()
    f = stats.merge(parts, processes * in_flight, sampler.cpu, sampler.util)
    f["lost"] = sum(int(p.get("lost", 0)) for p in parts)
    if sampler.error:
        f["gpu_busy_error"] = sampler.error
    lat = f["latency"]
    progress.note(f"{processes} x {in_flight}: {f['per_s']:,.1f}/s, p50 {lat.get('p50_us', 0) / 1e3:,.2f} ms, "
                  f"p99 {lat.get('p99_us', 0) / 1e3:,.2f} ms, {f['errors']} errors, answers "
                  f"{f['answers']['checked']} checked / {f['answers']['wrong']} wrong, host CPU "
                  f"{f['cpu_us_per_request']['host']} us/answer")
    return f


def route(progress: Progress, s: Setup, name: str, client: str, base: dict[str, Any], roots: list[int]) -> Figures:
    """Concurrency 1, then each depth; ``best`` is the depth of the most answers/s."""
    progress.phase(f"{name}: {client}")
    out: Figures = {"client": client, "protocol": base["protocol"]}
    try:
        out["c1"] = measure(progress, s, base, 1, 1, s.c1_duration_s, roots)
        out["saturation"] = [measure(progress, s, base, s.processes, k, s.duration_s, roots) for k in s.depths]
        out["best"] = stats.best(out["saturation"])
        wrong = sum(m["answers"]["wrong"] for m in (out["c1"], *out["saturation"]))
        if wrong:
            s.failures.append(f"{name} ({client}): {wrong} wrong answers")
    except BenchError as exc:
        out["error"] = str(exc)
        s.failures.append(f"{name} ({client}): {str(exc).splitlines()[0]}")
    return out


def run_shmbroker(progress: Progress, s: Setup, args: argparse.Namespace) -> Figures:
    from shmbroker.bench.http_bench import Frontend

    out: Figures = {"label": LABELS["shmbroker"], "routes": {}}
    workdir = s.workdir / "shmbroker"
    workdir.mkdir()
    with BrokerProcess(s.config_path, workdir, progress) as broker:
        if broker.proc is None:
            raise BenchError("the broker did not start")
        out["startup_s"] = broker.startup_s
        out["routes"]["ring"] = route(progress, s, "shmbroker", "Client.call (rings)",
                                      {"protocol": "ring", "runtime_dir": str(broker.runtime_dir)}, [broker.proc.pid])
        slots = max(32, 2 * s.processes * max(s.depths) // args.http_workers)
        memory = str(max(512, slots * args.http_workers * 2))  # every body in flight, all from one peer address
        front = Frontend(broker.runtime_dir, args.http_workers, workdir / "http.log", slots=slots,
                         extra=["--body-memory-mib", memory, "--peer-body-memory-mib", memory,
                                "--max-connections", str(max(512, 2 * s.processes * max(s.depths)))])
        try:
            out["routes"]["http"] = route(
                progress, s, "shmbroker", f"HTTP front-end ({args.http_workers} processes), KServe v2 binary",
                {"protocol": "kserve", "url": f"{front.url}/v2/models/{s.model}/infer"},
                [broker.proc.pid, front.proc.pid])
        finally:
            out["http_exit_code"] = front.stop()
    out["broker"] = broker.shutdown_figures()
    return out


def start_peer(s: Setup, peer: str, args: argparse.Namespace) -> tuple[ServerProcess, dict[str, tuple[str, Figures]]]:
    """The peer's server process and its routes: name -> (client description, load spec)."""
    common = ["--config", str(s.config_path), "--model", s.model]
    log = s.workdir / f"{peer}.log"
    if peer == "pytriton":
        http, grpc, metrics = free_port(), free_port(), free_port()
        server = ServerProcess("PyTriton", "shmbroker.bench.peers.pytriton_peer",
                               [*common, "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port",
                                str(metrics), "--instances", str(args.instances)], log,
                               f"http://127.0.0.1:{http}/v2/models/{s.model}/ready",
                               env={**python_library_env(), "PYTHONPATH": ""}, python=pytriton_python(s.workdir))
        return server, {
            "grpc": ("tritonclient gRPC, async_infer", {"protocol": "triton-grpc", "url": f"127.0.0.1:{grpc}"}),
            "http": ("HTTP, KServe v2 binary", {"protocol": "kserve",
                                                "url": f"http://127.0.0.1:{http}/v2/models/{s.model}/infer"}),
        }
    port = free_port()
    if peer == "litserve":
        server = ServerProcess("LitServe", "shmbroker.bench.peers.litserve_peer",
                               [*common, "--port", str(port), "--workers", str(args.litserve_workers)], log,
                               f"http://127.0.0.1:{port}/health")
        return server, {"http": ("HTTP, raw body", {"protocol": "raw", "url": f"http://127.0.0.1:{port}/predict"})}
    server = ServerProcess("FastAPI batcher", "shmbroker.bench.peers.fastapi_peer",
                           [*common, "--port", str(port), "--instances", str(args.instances)], log,
                           f"http://127.0.0.1:{port}/health")
    return server, {"http": ("HTTP, raw body", {"protocol": "raw", "url": f"http://127.0.0.1:{port}/infer"})}


def run_peer(progress: Progress, s: Setup, peer: str, args: argparse.Namespace) -> Figures:
    out: Figures = {"label": LABELS[peer], "routes": {}}
    progress.phase(f"{LABELS[peer]}: starting")
    server, routes = start_peer(s, peer, args)
    try:
        out["startup_s"] = server.wait_ready(args.ready_timeout)
        progress.done(f"ready in {out['startup_s']:.1f} s")
        out["pids_at_start"] = len(server.pids())
        for name, (client, spec) in routes.items():
            out["routes"][name] = route(progress, s, LABELS[peer], client, spec, [server.proc.pid])
    finally:
        out["exit_code"] = server.stop()
        out["killed"] = server.killed
        out["log_tail"] = server.log_tail(1500)
    return out


def settings(args: argparse.Namespace, s: Setup, cfg_path: Path) -> Figures:
    mc = config.load(cfg_path).models[s.model]
    return {"model": s.model, "engine": mc.engine, "max_batch": mc.max_batch,
            "max_queue_delay_us": mc.max_queue_delay_us, "streams": mc.streams, "processes": s.processes,
            "in_flight": s.depths, "duration_s": s.duration_s, "warmup_s": s.warmup_s,
            "c1_duration_s": s.c1_duration_s, "rows": len(s.rows), "tolerance": s.tolerance,
            "instances": args.instances, "litserve_workers": args.litserve_workers,
            "http_workers": args.http_workers}


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m shmbroker.bench.peers.run", description=__doc__.split("\n\n")[0])
    ap.add_argument("--peers", default=",".join(PEERS), help=f"servers to run, in order (default {','.join(PEERS)})")
    ap.add_argument("--config", default="", help="broker config (default: configs/default.toml on the CPU, "
                                                 "bench/gpu.toml with a GPU --engine)")
    ap.add_argument("--model", default="nsfw", help="the config's model every server runs (default nsfw)")
    ap.add_argument("--engine", default="", help="replace the model's engine (inductor: with --package)")
    ap.add_argument("--package", default="", help="the inductor package (shmbroker build --engine inductor)")
    ap.add_argument("--max-batch", type=int, default=0, help="replace the model's max_batch, for every server")
    ap.add_argument("--streams", type=int, default=0, help="replace the model's streams (the broker's stream slots)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="any other key of the model")
    ap.add_argument("--processes", type=int, default=4, help="client processes at saturation (16 on the GPU)")
    ap.add_argument("--in-flight", default="4", help="requests in flight per process, one depth or a list 8,48")
    ap.add_argument("--duration", type=float, default=3.0, help="each saturation window, seconds")
    ap.add_argument("--c1-duration", type=float, default=2.0, help="the concurrency-1 window, seconds")
    ap.add_argument("--warmup", type=float, default=1.0, help="uncounted seconds before each window")
    ap.add_argument("--limit-seconds", type=float, default=2.0, help="the in-process measurements' time")
    ap.add_argument("--rows", type=int, default=8, help="distinct input rows the clients send in turn")
    ap.add_argument("--tolerance", type=float, default=-1.0,
                    help="max abs difference of an answer from the reference (default 1e-4 on the CPU, 2e-2 on a GPU)")
    ap.add_argument("--instances", type=int, default=1, help="engine instances of PyTriton and the FastAPI batcher")
    ap.add_argument("--litserve-workers", type=int, default=1, help="LitServe's workers_per_device")
    ap.add_argument("--http-workers", type=int, default=2, help="processes of shmbroker's HTTP front-end")
    ap.add_argument("--ready-timeout", type=float, default=300.0, help="seconds a server has to become ready")
    ap.add_argument("--out", default="", help="write the JSON document here (the table goes to stdout)")
    args = ap.parse_args(argv)
    peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    unknown = [p for p in peers if p not in PEERS]
    if unknown or not peers:
        ap.error(f"--peers: unknown {unknown or 'nothing given'}; choose from {','.join(PEERS)}")
    args.peer_list = peers
    try:
        args.depths = [int(x) for x in args.in_flight.split(",")]
    except ValueError:
        ap.error(f"--in-flight: give numbers like 48 or 8,48, not {args.in_flight!r}")
    for name, value in (("--processes", args.processes), ("--instances", args.instances),
                        ("--litserve-workers", args.litserve_workers), ("--http-workers", args.http_workers),
                        ("--rows", args.rows), *(("--in-flight", d) for d in args.depths)):
        if value < 1:
            ap.error(f"{name} must be at least 1, got {value}")
    if args.engine == "inductor" and not args.package:
        ap.error("--engine inductor needs --package PATH (shmbroker build --engine inductor)")
    return args


def main(argv: list[str] | None = None) -> int:
    from shmbroker.bench.report import machine

    args = parse(argv)
    progress = Progress()
    t0 = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="shmbroker-bench-peers-"))
    try:
        cfg_path = write_config(args, workdir)
    except config.ConfigError as exc:
        print(f"bench.peers: {exc}", file=sys.stderr)
        return 2
    mi, rows, reference, inproc = inprocess(progress, cfg_path, args.model, args.rows, args.limit_seconds)
    tolerance = args.tolerance if args.tolerance >= 0 else answers.DEFAULT_TOLERANCE["cpu" if mi.device == "cpu"
                                                                                     else "gpu"]
    gpu = None if mi.device == "cpu" else int(mi.device)
    s = Setup(cfg_path, args.model, mi, rows, reference, tolerance, args.processes, args.depths, args.duration,
              args.warmup, args.c1_duration, gpu, workdir)
    doc: Figures = {"schema": SCHEMA, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "machine": machine(), "device_name": None if gpu is None else gpu_name(gpu),
                    "config": {"path": str(cfg_path), "text": cfg_path.read_text()}, "settings": settings(args, s,
                                                                                                         cfg_path),
                    "model_info": mi.as_dict(), "peers_run": args.peer_list, "inprocess": inproc, "servers": {}}
    for peer in args.peer_list:
        missing = missing_modules(peer)
        if missing:
            why = f"not installed: {', '.join(missing)} (pip install {NEEDS[peer][1]})"
            doc["servers"][peer] = {"label": LABELS[peer], "error": why}
            s.failures.append(f"{LABELS[peer]}: {why}")
            progress.note(f"{LABELS[peer]} skipped: {why}")
            continue
        try:
            doc["servers"][peer] = run_shmbroker(progress, s, args) if peer == "shmbroker" else run_peer(
                progress, s, peer, args)
        except BenchError as exc:
            doc["servers"][peer] = {"label": LABELS[peer], "error": str(exc)}
            s.failures.append(f"{LABELS[peer]}: {str(exc).splitlines()[0]}")
            progress.note(f"{LABELS[peer]} failed: {exc}")
    doc["failures"] = s.failures
    doc["elapsed_s"] = round(time.monotonic() - t0, 1)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(doc, indent=2, default=_jsonable) + "\n")
        progress.note(f"wrote {args.out}")
    sys.stdout.write(table.render([json.loads(json.dumps(doc, default=_jsonable))]))
    for f in s.failures:
        progress.note(f"FAILED: {f}")
    return 1 if s.failures else 0


def _jsonable(value: Any) -> Any:
    import numpy as np

    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON")


if __name__ == "__main__":
    raise SystemExit(main())
