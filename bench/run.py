"""``shmbroker bench``: the broker against a raw ZeroMQ echo and the in-process engine limit, in one run.

Order: with the echo server and the bench's own broker both up, (1) the floor's latency, then echo and
``tiny`` latency at concurrency 1 in interleaved rounds, (2) echo and ``tiny`` throughput at 4 processes x 8
in flight in interleaved rounds (bench/paired.py: each target ratio is the median of the rounds'), (3) the
in-process ONNX Runtime sweep for ``nsfw`` over shapes and batch sizes (broker idle), then its best shape
and batch size and ``nsfw`` throughput at 4 processes x 4 in flight, in interleaved rounds the same way;
then the broker is stopped with SIGTERM and /dev/shm checked. Each ratio's figures are measured in turns,
under the same machine conditions.
``--plot``/``--sweep-only`` add the concurrency sweep (bench/sweep.py) after the broker's phases (or instead
of them), and the picture (bench/plot.py). bench/README.md has the details.
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import json
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import psutil

from shmbroker.bench import echo, inprocess, load, paired, photo_load, photoset, plot, report, sweep
from shmbroker.bench.broker_proc import BrokerProcess, counters_delta, model_counters
from shmbroker.bench.common import BenchError, Figures, Progress, latency_summary
from shmbroker.bench.procs import Target, run_group
from shmbroker.broker.common import config

PROCESSES = 4
TINY_IN_FLIGHT = 8  # per process: 32 in flight
NSFW_IN_FLIGHT = 4  # per process: 16 in flight
NSFW_BATCH_SIZES = [1, 8, 16]
TINY = "tiny"
NSFW = "nsfw"
PHOTO = "nsfw_photo"
PHOTO_SIZE = (1280, 960)  # the demo's photos: a phone photo as an upload form scales it


@dataclass(frozen=True)
class Settings:
    quick: bool
    duration_s: float  # each throughput window
    warmup_s: float  # run, uncounted, before each window
    latency_requests: int
    latency_warmup: int
    inprocess_s: float  # per shape and batch size in the nsfw sweep
    rounds: int  # interleaved rounds of each target's two sides (bench/paired.py)
    processes: int = PROCESSES
    tiny_in_flight: int = TINY_IN_FLIGHT
    nsfw_in_flight: int = NSFW_IN_FLIGHT
    sweep: bool = False  # the concurrency sweep runs (--plot or --sweep-only)
    sweep_only: bool = False  # and nothing else does
    sweep_window_s: float = 2.0  # each sweep point's window

    @classmethod
    def of(cls, args: argparse.Namespace) -> Settings:
        quick = bool(args.quick)
        duration = args.duration if args.duration is not None else (2.0 if quick else 5.0)
        requests = args.requests if args.requests is not None else (2000 if quick else 5000)
        window = args.sweep_window if args.sweep_window is not None else (1.0 if quick else 2.0)
        rounds = args.rounds if args.rounds is not None else (1 if quick else 3)
        return cls(quick=quick, duration_s=duration, warmup_s=0.5 if quick else 1.0, latency_requests=requests,
                   latency_warmup=max(100, requests // 10), inprocess_s=duration, rounds=rounds,
                   sweep=bool(args.plot or args.sweep_only), sweep_only=bool(args.sweep_only), sweep_window_s=window)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--json", action="store_true",
                    help="write the JSON document (to stdout, the table then goes to stderr; or to --out)")
    ap.add_argument("--out", default=None, metavar="FILE", help="write the JSON document to FILE (implies --json)")
    ap.add_argument("--quick", action="store_true", help="shorter windows (2 s) and fewer latency requests (2000)")
    ap.add_argument("--config", default=None, metavar="PATH",
                    help="broker config to benchmark (default: configs/default.toml); needs models tiny and nsfw")
    ap.add_argument("--duration", type=float, default=None, metavar="SECONDS",
                    help="each throughput window (default 5, 2 with --quick)")
    ap.add_argument("--requests", type=int, default=None, metavar="N",
                    help="latency requests at concurrency 1 (default 5000, 2000 with --quick)")
    ap.add_argument("--rounds", type=int, default=None, metavar="N",
                    help="interleaved rounds of each target's two sides (echo and tiny latency, echo and tiny "
                         "throughput, nsfw in-process and via the broker); each target ratio is the median of the "
                         "rounds' ratios (default 3, 1 with --quick)")
    ap.add_argument("--plot", default=None, metavar="FILE.png",
                    help="also run the concurrency sweep and draw throughput against p50/p99 latency to FILE.png "
                         "(needs the plot extra: pip install 'shmbroker[plot]')")
    ap.add_argument("--sweep-only", action="store_true",
                    help="run only the concurrency sweep (with --plot: the picture; the JSON/table have its figures)")
    ap.add_argument("--sweep-window", type=float, default=None, metavar="SECONDS",
                    help="each sweep point's window (default 2, 1 with --quick)")
    ap.add_argument("--http", action="store_true",
                    help="the HTTP front-end against the ring client instead (bench/http_bench.py, bench/README.md)")
    ap.add_argument("--http-workers", type=int, default=2, help="--http: front-end processes (default 2)")
    ap.add_argument("--ray", action="store_true",
                    help="Ray Serve's handle and HTTP proxy against the direct client instead (bench/ray_bench.py; "
                         "needs the [ray] extra)")
    ap.add_argument("--rows", type=int, default=1, metavar="N", help="--ray: rows a request (default 1)")
    ap.add_argument("--gpu", action="store_true",
                    help="the GPU benchmark instead (bench/gpu.py; default config bench/gpu.toml; see bench/README.md)")
    ap.add_argument("--photos", action="store_true",
                    help="the photo benchmark instead (bench/photos.py: photos decoded by the worker against the "
                         "in-process limit and against Pillow in the clients; see bench/README.md)")
    photoset.add_arguments(ap)
    ap.add_argument("--processes", type=int, default=None,
                    help="--gpu: client processes (default 16); --photos: 16 on a GPU worker, 4 on a CPU one")
    ap.add_argument("--in-flight", type=int, default=None,
                    help="--gpu: requests each client keeps in flight (default 8); --photos: 16 on a GPU worker, 4 on "
                         "a CPU one")
    ap.add_argument("--c-client", default=None, metavar="BINARY",
                    help="--photos: examples/c's shmb_client (make -C examples/c OUT=DIR): adds (b'), the same load "
                         "from C client processes")
    ap.add_argument("--photos-per-request", type=int, default=1, metavar="K",
                    help="--photos: photos in each of (b)'s requests (default 1): its figures stay per photo, its "
                         "latencies per request")
    ap.add_argument("--log-dir", default=None, metavar="DIR", help="--gpu: keep the broker's log there")
    ap.add_argument("--engines", default="", metavar="NAMES",
                    help="--gpu: torch,inductor,null: each engine's (a) and (c) side by side (default: the config's)")
    ap.add_argument("--null-compute-us", type=int, default=100, metavar="US",
                    help="--gpu: the null column's device time per batch (default 100)")
    ap.add_argument("--inductor", default="", metavar="PACKAGE", help="--gpu: the inductor column's package")
    ap.add_argument("--sweep-max", type=int, default=256, metavar="N", help="--gpu: (a) sweeps batches up to N")
    ap.add_argument("--max-batch", type=int, default=0, metavar="N", help="--gpu: the model's max_batch in (c)")
    ap.add_argument("--streams", type=int, default=0, metavar="N", help="--gpu: the model's stream slots in (c)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="model_options",
                    help="--gpu: a key of the model's section in (c), or SECTION.KEY of another (repeatable)")
    ap.add_argument("--api", choices=("call", "infer", "request"), default="call",
                    help="--gpu: (c)'s clients, Client.call chains (default), threads calling Client.infer, or "
                         "threads running zero-copy requests")
    ap.add_argument("--client-spin-us", type=int, default=1000, metavar="US",
                    help="--gpu: (c)'s clients' Client(spin_us=...) (default 1000; 0: never spin)")
    ap.add_argument("--worker-nice", type=int, default=None, metavar="N",
                    help="--gpu: (c)'s workers at nice N once ready (a negative N needs root)")
    ap.add_argument("--only", default="copies,limit,classic,broker", metavar="PHASES",
                    help="--gpu: a subset of copies,limit,classic,broker")


def _now_iso() -> str:
    return dt.datetime.now(dt.UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def _throughput(results: list[Figures], in_flight: int) -> Figures:
    per_process = [
        {"completed": r["completed"], "errors": r["errors"], "per_s": round(r["completed"] / r["window_s"], 1),
         **({"error_codes": r["error_codes"]} if r.get("error_codes") else {}),
         **({"lost": r["lost"]} if r.get("lost") else {})}
        for r in results
    ]
    return {
        "processes": len(results),
        "in_flight_per_process": in_flight,
        "concurrency": len(results) * in_flight,
        "window_s": results[0]["window_s"],
        "completed": sum(r["completed"] for r in results),
        "errors": sum(r["errors"] for r in results),
        "per_s": round(sum(r["completed"] / r["window_s"] for r in results), 1),
        "per_process": per_process,
    }


class Bench:
    def __init__(self, cfg: config.Config, cfg_path: Path, s: Settings, progress: Progress) -> None:
        self.cfg = cfg
        self.cfg_path = cfg_path
        self.s = s
        self.progress = progress
        self.measurements: dict[str, Figures] = {}
        self.failures: list[str] = []
        self.broker: BrokerProcess | None = None

    def phase(self, key: str, title: str, fn: Callable[[], Figures], summary: Callable[[Figures], str]) -> None:
        self.progress.phase(title)
        psutil.cpu_percent(None)  # the next call gives the machine's busy % over the phase
        try:
            figures = fn()
        except BenchError as exc:
            self.measurements[key] = {"error": str(exc)}
            self.failures.append(f"{key}: {exc}")
            self.progress.note(f"FAILED: {exc}")
            return
        figures["machine_cpu_busy_pct"] = psutil.cpu_percent(None)
        self.measurements[key] = figures
        self.progress.done(summary(figures))

    def skip(self, key: str, why: str) -> None:
        self.measurements[key] = {"error": f"skipped: {why}"}
        self.failures.append(f"{key}: skipped: {why}")
        self.progress.note(f"{key} skipped: {why}")

    # -- phases ---------------------------------------------------------------------------------------------
    def inprocess_nsfw(self) -> Figures:
        return inprocess.limit(self.cfg, NSFW, NSFW_BATCH_SIZES, self.s.inprocess_s, self.progress)

    def latency(self, target: Target, spec: Figures) -> Figures:
        (r,) = run_group(self.progress, target, [spec], expect_s=None)
        return {"concurrency": 1, "requests": self.s.latency_requests, "warmup_requests": self.s.latency_warmup,
                "errors": r["errors"], **({"error_codes": r["error_codes"]} if r.get("error_codes") else {}),
                "latency": r["latency"]}

    def throughput(self, target: Target, base: Figures, in_flight: int) -> Figures:
        specs = [{**base, "index": i, "seed": 1000 + i, "in_flight": in_flight, "warmup_s": self.s.warmup_s,
                  "duration_s": self.s.duration_s} for i in range(self.s.processes)]
        results = run_group(self.progress, target, specs, expect_s=self.s.warmup_s + self.s.duration_s)
        return {**_throughput(results, in_flight), "warmup_s": self.s.warmup_s}

    def with_server_counters(self, broker: BrokerProcess, model: str, fn: Callable[[], Figures]) -> Figures:
        before = model_counters(broker.stats())
        figures = fn()
        return {**figures, **counters_delta(before, model_counters(broker.stats()), model)}

    def run(self, workdir: Path) -> Figures:
        s = self.s
        self.progress.phase(f"starting the broker ({self.cfg_path}) and the echo server")
        broker = self.broker = BrokerProcess(self.cfg_path, workdir, self.progress)
        try:
            with echo.EchoServer(workdir) as server, echo.EchoServer(workdir, with_tiny=True) as floor, broker:
                self.progress.done(f"broker ready (instance {broker.instance}), echo server on {server.endpoint}")
                if not s.sweep_only:
                    self._broker_phases(broker, server.endpoint, floor.endpoint)
                if s.sweep:
                    self._sweep_phases(broker)
        except BenchError as exc:
            self.failures.append(f"broker: {exc}")
            self.progress.note(f"FAILED: {exc}")
        finally:
            broker.stop()
        shutdown = broker.shutdown_figures()
        if not shutdown["shm_clean"]:
            self.failures.append(f"broker shutdown not clean: {shutdown}")
        self.progress.phase("broker stopped")
        self.progress.done(f"exit code {shutdown['exit_code']}, /dev/shm "
                           f"{'clean' if not shutdown['shm_leaked'] else 'LEAKED ' + str(shutdown['shm_leaked'])}")
        return shutdown

    def _broker_phases(self, broker: BrokerProcess, endpoint: str, floor_endpoint: str) -> None:
        s = self.s
        rt = str(broker.runtime_dir)
        lat = {"requests": s.latency_requests, "warmup": s.latency_warmup}

        def lat_summary(f: Figures) -> str:
            return f"p50 {f['latency']['p50_us']:.1f} us, p99 {f['latency']['p99_us']:.1f} us, {f['errors']} errors"

        echo_lat = paired.Side("echo_latency", f"raw zmq echo latency, 1 in flight, {s.latency_requests} requests",
                               lambda: self.latency(echo.latency_client, {"endpoint": endpoint, **lat}), lat_summary)
        self.phase("floor_latency", f"floor: echo server that also runs tiny once per message, "
                   f"{s.latency_requests} requests",
                   lambda: self.latency(echo.latency_client, {"endpoint": floor_endpoint, **lat}), lat_summary)
        echo_tput = paired.Side("echo_throughput", f"raw zmq echo throughput, {s.processes} procs x "
                                f"{s.tiny_in_flight} in flight, {s.duration_s:g} s", lambda: self.throughput(
                                    echo.throughput_client, {"endpoint": endpoint, "warmup_requests": 50},
                                    s.tiny_in_flight), tput_summary("messages"))
        if TINY in self.cfg.models:
            # interleaved with the echo (bench/paired.py): each round's ratio is taken under one machine state
            tiny_lat = paired.Side("tiny_latency", f"tiny latency via the broker, 1 in flight, "
                                   f"{s.latency_requests} requests", lambda: self.with_server_counters(
                                       broker, TINY, lambda: self.latency(load.latency_client, {
                                           "runtime_dir": rt, "model": TINY, "seed": 1, **lat})), lat_summary)
            tiny_tput = paired.Side("tiny_throughput", f"tiny throughput via the broker, {s.processes} procs x "
                                    f"{s.tiny_in_flight} in flight, {s.duration_s:g} s", lambda: (
                                        self.with_server_counters(broker, TINY, lambda: self.throughput(
                                            load.throughput_client, {"runtime_dir": rt, "model": TINY,
                                                                     "warmup_requests": 50}, s.tiny_in_flight))),
                                    tput_summary("requests"))
            for pair in (paired.Pair(echo_lat, tiny_lat, ("p50_us", "p99_us")),
                         paired.Pair(echo_tput, tiny_tput, ("per_s",))):
                paired.run(pair, s.rounds, self.phase)
                paired.merge(self.measurements, pair, s.rounds)
        else:
            self.skip("tiny_latency", f"the config has no model {TINY!r}")
            self.skip("tiny_throughput", f"the config has no model {TINY!r}")
            self.phase(echo_lat.key, echo_lat.title, echo_lat.measure, echo_lat.summary)
            self.phase(echo_tput.key, echo_tput.title, echo_tput.measure, echo_tput.summary)
        if NSFW in self.cfg.models:
            self._nsfw_phases(broker)
        else:
            self.skip("nsfw_inprocess", f"the config has no model {NSFW!r}")
            self.skip("nsfw_throughput", f"the config has no model {NSFW!r}")
        self._photo_phase(broker)

    def _nsfw_phases(self, broker: BrokerProcess) -> None:
        """The in-process sweep (broker idle) picks the best shape and batch size; that one, kept loaded, and
        the broker's nsfw throughput then take turns in interleaved rounds, as echo and tiny do."""
        s = self.s
        self.phase("nsfw_inprocess_sweep", f"nsfw in-process ONNX Runtime sweep, batches {NSFW_BATCH_SIZES}, "
                   f"{s.inprocess_s:g} s each (broker idle)", self.inprocess_nsfw,
                   lambda f: f"{f['items_per_s']:.2f} images/s, {f['best_shape']}, batch {f['best_batch']}")
        sweep_figures = self.measurements["nsfw_inprocess_sweep"]
        if "error" in sweep_figures:
            self.skip("nsfw_inprocess", "the in-process sweep failed")
            self.skip("nsfw_throughput", "the in-process sweep failed")
            return
        with inprocess.Pinned(self.cfg, NSFW, sweep_figures) as pinned:
            limit_side = paired.Side(
                "nsfw_inprocess", f"nsfw in-process ONNX Runtime limit, {pinned.shape.name}, batch {pinned.batch}, "
                f"{s.duration_s:g} s (broker idle)", lambda: pinned.measure(s.duration_s),
                lambda f: f"{f['per_s']:.2f} images/s")
            nsfw_side = paired.Side(
                "nsfw_throughput", f"nsfw throughput via the broker, {s.processes} procs x {s.nsfw_in_flight} in "
                f"flight, 1 image each, {s.duration_s:g} s", lambda: self.with_server_counters(
                    broker, NSFW, lambda: self.throughput(load.throughput_client, {
                        "runtime_dir": str(broker.runtime_dir), "model": NSFW, "warmup_requests": 2, "rows": 1},
                        s.nsfw_in_flight)), tput_summary("images"))
            pair = paired.Pair(limit_side, nsfw_side, ("per_s",))
            paired.run(pair, s.rounds, self.phase)
            paired.merge(self.measurements, pair, s.rounds)

    def _photo_phase(self, broker: BrokerProcess) -> None:
        """Photos/s of the photo model: encoded JPEGs from the client processes, decoded by the worker (bench/photos.py
        measures them against their limits). Information, no target: a config or a machine without the model or
        the photographs skips it without failing the run."""
        s = self.s
        if PHOTO not in self.cfg.models:
            self.measurements["photo_throughput"] = {"error": f"skipped: the config has no model {PHOTO!r}"}
            return
        self.progress.phase("the photo set")
        try:
            photos = photoset.build([PHOTO_SIZE], None, self.progress)[PHOTO_SIZE]
        except BenchError as exc:
            self.measurements["photo_throughput"] = {"error": f"skipped: {exc}"}
            self.progress.note(f"photo phase skipped: {exc}")
            return
        self.progress.done(f"{len(photos.paths)} photos of {photoset.size_name(PHOTO_SIZE)}")
        base = {"runtime_dir": str(broker.runtime_dir), "model": PHOTO, "warmup_requests": 2,
                "paths": [str(p) for p in photos.paths], "processes": s.processes}
        self.phase("photo_throughput", f"{PHOTO} photos/s via the broker, {s.processes} procs x {s.nsfw_in_flight} "
                   f"{photoset.size_name(PHOTO_SIZE)} JPEGs in flight, {s.duration_s:g} s",
                   lambda: self.with_server_counters(broker, PHOTO, lambda: self.photos(base)), tput_summary("photos"))

    def photos(self, base: Figures) -> Figures:
        """One window of photo_load's encoded clients: photos/s and each photo's time from submit to answer."""
        s = self.s
        specs = [{**base, "index": i, "seed": 1000 + i, "in_flight": s.nsfw_in_flight, "warmup_s": s.warmup_s,
                  "duration_s": s.duration_s} for i in range(s.processes)]
        results = run_group(self.progress, photo_load.encoded_client, specs, expect_s=s.warmup_s + s.duration_s)
        return {**_throughput(results, s.nsfw_in_flight), "warmup_s": s.warmup_s,
                "latency": latency_summary([x for r in results for x in r["samples_ns"]]),
                "size": photoset.size_name(PHOTO_SIZE)}

    def _sweep_phases(self, broker: BrokerProcess) -> None:
        """One phase per model of ``sweep.PLANS`` (``<model>_sweep``); a model the config lacks is skipped."""
        for plan in sweep.PLANS:
            if plan.model not in self.cfg.models:
                self.skip(f"{plan.model}_sweep", f"the config has no model {plan.model!r}")
                continue
            run = functools.partial(sweep.sweep, self.progress, str(broker.runtime_dir), plan,
                                    self.s.sweep_window_s, broker.stats)
            self.phase(f"{plan.model}_sweep", f"{plan.model} concurrency sweep via the broker, in flight "
                       f"{list(plan.concurrencies)}, {self.s.sweep_window_s * plan.window_scale:g} s each", run,
                       sweep.summary)


def tput_summary(unit: str) -> Callable[[Figures], str]:
    return lambda f: f"{f['per_s']:,.1f} {unit}/s, {f['errors']} errors"


def _interrupt(signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def _write(text: str, stream: Any) -> None:
    stream.write(text)
    stream.flush()


def _draw(doc: Figures, path: Path, bench: Bench, progress: Progress) -> None:
    """The sweep's picture; its path goes into the document as ``plot`` (null, and a failure, if not drawn)."""
    doc["plot"] = None
    try:
        plot.write(doc, path)
    except BenchError as exc:
        bench.failures.append(f"plot: {exc}")
        progress.note(f"plot FAILED: {exc}")
        return
    doc["plot"] = str(path)
    progress.note(f"wrote {path} ({path.stat().st_size:,} bytes)")


def main(args: argparse.Namespace) -> int:
    if args.gpu:
        from shmbroker.bench.gpu import main as gpu_main

        return gpu_main(args)
    if args.photos:
        from shmbroker.bench.photos import main as photos_main

        return photos_main(args)
    if args.http:
        from shmbroker.bench.http_bench import main as http_main

        return http_main(args)
    if args.ray:
        from shmbroker.bench.ray_bench import main as ray_main

        return ray_main(args)
    if args.plot:
        try:
            plot.require()  # before minutes of measuring, not after
        except BenchError as exc:
            sys.stderr.write(f"shmbroker bench: {exc}\n")
            return 2
    if args.rounds is not None and args.rounds < 1:
        sys.stderr.write(f"shmbroker bench: --rounds must be at least 1, got {args.rounds}\n")
        return 2
    progress = Progress()
    cfg_path = Path(args.config).resolve() if args.config else config.DEFAULT_CONFIG
    cfg = config.load(cfg_path)  # a ConfigError is reported by the CLI (exit 2)
    s = Settings.of(args)
    want_json = bool(args.json or args.out)
    doc: Figures = {
        "schema": "shmbroker-bench/2",
        "date": _now_iso(),
        "machine": {**report.machine(), "background_cpu_busy_pct": psutil.cpu_percent(1.0)},
        "config": {"path": str(cfg_path), "settings": config.to_dict(cfg)},
        "settings": asdict(s),
    }
    bench = Bench(cfg, cfg_path, s, progress)
    workdir = Path(tempfile.mkdtemp(prefix="shmbroker-bench-"))
    previous = signal.signal(signal.SIGTERM, _interrupt)  # SIGTERM, like Ctrl-C, still stops the broker
    try:
        doc["broker"] = bench.run(workdir)
    except KeyboardInterrupt as exc:
        progress.note(f"interrupted ({exc or 'SIGINT'}); the broker and the client processes were stopped")
        bench.failures.append("interrupted")
        if bench.broker is not None:
            bench.broker.stop()
            doc["broker"] = bench.broker.shutdown_figures()
    finally:
        signal.signal(signal.SIGTERM, previous)
        shutil.rmtree(workdir, ignore_errors=True)
    doc["measurements"] = bench.measurements
    doc["ratios"] = {} if s.sweep_only else report.ratios(bench.measurements)
    doc["info_ratios"] = {} if s.sweep_only else report.info_ratios(bench.measurements)
    doc["failures"] = bench.failures
    doc["machine"]["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    doc["elapsed_s"] = round(progress.elapsed(), 1)
    if args.plot:
        _draw(doc, Path(args.plot), bench, progress)
    text = json.dumps(doc, indent=2) + "\n"
    human = report.table(doc) + sweep.table(bench.measurements)
    if want_json and not args.out:
        _write(human, sys.stderr)
        _write(text, sys.stdout)
    else:
        if args.out:  # the file first: minutes of figures must not hang on a closed stdout
            out = Path(args.out)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(text)
            progress.note(f"wrote {out}")
        _write(human, sys.stdout)
    if bench.failures:
        sys.stderr.write("shmbroker bench: " + "; ".join(f.splitlines()[0] for f in bench.failures) + "\n")
        return 1
    return 0
