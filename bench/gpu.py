"""``shmbroker bench --gpu`` (or ``python -m shmbroker.bench.gpu``): the GPU pipeline against its two yardsticks,
one run.

Order: copy calls (per call against batched), (b) the classic synchronous server under the 16 client processes,
then for each engine of ``--engines`` (eager PyTorch with CUDA graphs, the inductor package): (a) its in-process
limit over a batch sweep up to 256 and (c) shmbroker on it under 16 client processes each sending batch-1
requests, GPU utilization sampled meanwhile. bench/README.md says what each figure means.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from shmbroker.bench import gpu_classic, gpu_inprocess, gpu_load, gpu_report, gpu_variants, report
from shmbroker.bench.broker_proc import BrokerProcess
from shmbroker.bench.common import BenchError, Figures, Progress
from shmbroker.bench.procs import Target
from shmbroker.broker.common import config

DEFAULT_CONFIG = Path(__file__).resolve().parent / "gpu.toml"
MODEL = "nsfw"
PHASES = ("copies", "limit", "classic", "broker")
ENGINES = ("torch", "inductor", "null")


@dataclass(frozen=True)
class Settings:
    duration_s: float
    warmup_s: float
    processes: int
    in_flight: int
    classic: bool = True
    api: str = "call"
    client_spin_us: int = 1000
    worker_nice: int | None = None

    @classmethod
    def of(cls, args: argparse.Namespace) -> Settings:
        quick = bool(args.quick)
        duration = args.duration if args.duration is not None else (2.0 if quick else 5.0)
        processes = args.processes if args.processes is not None else 16  # None: shmbroker bench's default
        in_flight = args.in_flight if args.in_flight is not None else 8
        return cls(duration, 0.5 if quick else 1.0, processes, in_flight, api=getattr(args, "api", "call"),
                   client_spin_us=getattr(args, "client_spin_us", 1000), worker_nice=getattr(args, "worker_nice", None))


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """``python -m shmbroker.bench.gpu``'s options; ``shmbroker bench --gpu`` takes the same (bench/run.py)."""
    ap.add_argument("--json", action="store_true", help="JSON on stdout (the table then goes to stderr)")
    ap.add_argument("--out", default=None, metavar="FILE", help="write the JSON document to FILE")
    ap.add_argument("--quick", action="store_true", help="2 s windows")
    ap.add_argument("--config", default=None, metavar="PATH", help="broker config (default bench/gpu.toml)")
    ap.add_argument("--duration", type=float, default=None, metavar="SECONDS", help="each window (default 5)")
    ap.add_argument("--processes", type=int, default=16, help="client processes in (b) and (c) (default 16)")
    ap.add_argument("--in-flight", type=int, default=8, help="requests each (c) client keeps in flight (default 8)")
    ap.add_argument("--client-spin-us", type=int, default=1000, metavar="US",
                    help="(c)'s clients' Client(spin_us=...): how long their threads spin for answers (default "
                         "1000; 0: never), to see what spinning clients take from the worker's cores")
    ap.add_argument("--worker-nice", type=int, default=None, metavar="N",
                    help="(c): set the broker's workers to nice N once ready (a negative N needs root), to see "
                         "whether the client processes' CPU use delays the worker's threads")
    ap.add_argument("--api", choices=("call", "infer", "request"), default="call",
                    help="(c)'s clients: Client.call chains (default), or threads calling Client.infer in a loop, "
                         "as a synchronous application does, or threads running zero-copy requests "
                         "(Client.request, the input written in the slot before the timing starts)")
    ap.add_argument("--log-dir", default=None, metavar="DIR", help="keep the broker's log there")
    ap.add_argument("--only", default=",".join(PHASES), metavar="PHASES",
                    help=f"comma-separated subset of {','.join(PHASES)} (tuning runs; targets then read n/a)")
    ap.add_argument("--engines", default="", metavar="NAMES",
                    help=f"comma-separated subset of {','.join(ENGINES)}, each measured with (a) and (c) "
                         "(default: the config's engine)")
    ap.add_argument("--inductor", default="", metavar="PACKAGE",
                    help="the inductor column's package (shmbroker build --engine inductor)")
    ap.add_argument("--null-compute-us", type=int, default=100, metavar="US",
                    help="the null column's device time per batch, whatever its rows (default 100): small, so that "
                         "the host path sets what the broker serves")
    ap.add_argument("--sweep-max", type=int, default=256, metavar="N",
                    help="(a) sweeps batch sizes 1, 2, 4, ... up to N whatever the config's max_batch (default 256)")
    ap.add_argument("--max-batch", type=int, default=0, metavar="N",
                    help="the model's max_batch in (c), instead of the config's")
    ap.add_argument("--streams", type=int, default=0, metavar="N",
                    help="the model's stream slots in (c), instead of the config's")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="model_options",
                    help=f"a key of [models.{MODEL}] in (c), or SECTION.KEY of another section, instead of the "
                         "config's (repeatable; say batching=triton, worker.spin_us=0)")


@dataclass(frozen=True)
class Column:
    """One engine's column: the config it runs with, written where its broker reads it."""

    engine: str
    cfg: config.Config
    path: Path


class GpuBench:
    def __init__(self, cfg: config.Config, s: Settings, progress: Progress, sweep_max: int = 256) -> None:
        self.cfg, self.s, self.progress, self.sweep_max = cfg, s, progress, sweep_max
        self.device = int(cfg.worker.devices[0])
        self.measurements: dict[str, Figures] = {"engines": {}}
        self.failures: list[str] = []
        self.log_dir: Path | None = None

    def phase(self, into: Figures, key: str, title: str, fn: Any) -> None:
        self.progress.phase(title)
        try:
            into[key] = fn()
            self.progress.done(gpu_report.summary(key, into[key]))
        except (BenchError, RuntimeError, OSError) as exc:  # CudaError, EngineError are RuntimeErrors
            self.failures.append(f"{title}: {exc}")
            into[key] = {"error": str(exc)}
            self.progress.note(f"FAILED: {exc}")

    def specs(self, extra: Figures) -> list[dict[str, Any]]:
        return [{"index": i, "seed": 100 + i, "shape": [1, 224, 224, 3], "warmup_s": self.s.warmup_s,
                 "duration_s": self.s.duration_s, **extra} for i in range(self.s.processes)]

    def run(self, workdir: Path, only: set[str], columns: list[Column]) -> None:
        m = self.measurements
        if "copies" in only:
            self.phase(m, "copies", "copy calls: one per request against one batched call",
                       lambda: gpu_inprocess.copies(self.device, 224 * 224 * 3 * 4, 2 * 4))
        if "classic" in only:
            self.phase(m, "classic", f"(b) classic synchronous server, {self.s.processes} client processes",
                       lambda: self.classic(workdir))
        for col in columns:
            into: Figures = m["engines"].setdefault(col.engine, {})
            if "limit" in only:
                self.phase(into, "limit", f"(a) {col.engine}: in-process limit, CUDA graphs, batches up to "
                           f"{self.sweep_max}", lambda col=col: gpu_inprocess.limit(
                               col.cfg, MODEL, self.device, 2 * self.s.duration_s, self.progress, self.sweep_max))
            if "broker" in only:
                self.phase(into, "broker", f"(c) {col.engine}: shmbroker, {self.s.processes} processes x "
                           f"{self.s.in_flight} batch-1 requests ({self.s.api})",
                           lambda col=col: self.broker(workdir, col))

    def _group(self, target: Target, specs: list[dict[str, Any]], sampler: gpu_load.Sampler) -> Figures:
        return gpu_load.group(self.progress, target, specs, sampler, self.s.warmup_s, self.s.duration_s)

    def classic(self, workdir: Path) -> Figures:
        mc = self.cfg.models[MODEL]
        from shmbroker.gpu_worker import model_source

        endpoint = f"ipc://{workdir}/classic.sock"
        with gpu_classic.ClassicServer(endpoint, str(model_source.resolve(self.cfg.model_path(MODEL))), self.device,
                                       mc.fp16):
            specs = self.specs({"endpoint": endpoint, "warmup_requests": 3})
            out = self._group(gpu_classic.client, specs, gpu_load.Sampler(self.device))
        return {**out, "fp16": mc.fp16, "clients": self.s.processes}

    def broker(self, workdir: Path, col: Column) -> Figures:
        mc = col.cfg.models[MODEL]
        run_dir = workdir / col.engine
        run_dir.mkdir(exist_ok=True)
        with BrokerProcess(col.path, run_dir, self.progress) as b:
            self.progress.note(f"broker ready in {b.startup_s:.1f} s")
            if self.s.worker_nice is not None:
                self.progress.note(f"workers {b.renice_workers(self.s.worker_nice)} at nice {self.s.worker_nice}")
            specs = self.specs({"runtime_dir": str(b.runtime_dir), "model": MODEL, "in_flight": self.s.in_flight,
                                "api": self.s.api, "spin_us": self.s.client_spin_us, "warmup_requests": 20})
            sampler = gpu_load.Sampler(self.device, b.runtime_dir)
            try:
                out = self._group(gpu_load.client, specs, sampler)
            finally:
                if self.log_dir is not None:
                    self.log_dir.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(b.log_path, self.log_dir / f"broker-{col.engine}.log")
            window = sampler.stats_window(*out["window_monotonic"])
            if window is not None:
                before, after = window
                out["stages"] = gpu_load.stage_figures(before.stats, after.stats, MODEL, after.t - before.t)
                out["outside_worker_ms"] = gpu_load.outside_worker_ms(out["latency"], out["stages"])
                out["worker_cpu_us_per_request"] = gpu_load.worker_cpu(before, after, MODEL)
                out["worker_runq_us_per_request"] = gpu_load.worker_cpu(before, after, MODEL, "waits")
                out["worker_preempted_per_1k_requests"] = gpu_load.worker_cpu(before, after, MODEL, "preempted")
                out["host_cpu"] = gpu_load.host_cpu(before, after)
        out["shutdown"] = b.shutdown_figures()
        out["startup_s"] = None if b.startup_s is None else round(b.startup_s, 2)
        if not out["shutdown"]["shm_clean"]:
            self.failures.append(f"broker ({col.engine}): unclean shutdown {out['shutdown']}")
        return {**out, "clients": self.s.processes, "in_flight_per_client": self.s.in_flight, "api": self.s.api,
                "client_spin_us": self.s.client_spin_us, "worker_nice": self.s.worker_nice, "max_batch": mc.max_batch,
                "max_queue_delay_ms": mc.max_queue_delay_us / 1e3}


def columns(cfg: config.Config, args: argparse.Namespace, workdir: Path) -> list[Column]:
    """The engine columns that ``--engines`` asks for, each with its config written into ``workdir``."""
    names = [e.strip() for e in (args.engines or cfg.models[MODEL].engine).split(",") if e.strip()]
    unknown = sorted(set(names) - set(ENGINES))
    if unknown:
        raise SystemExit(f"--engines: {unknown} are not among {list(ENGINES)}")
    package = args.inductor or (cfg.model_path(MODEL) if cfg.models[MODEL].engine == "inductor" else "")
    out = []
    for name in names:
        try:
            options = gpu_variants.parse_options(getattr(args, "model_options", []))
            if name == "null":
                options = {"null_compute_us": args.null_compute_us, **options}
            variant = gpu_variants.engine_config(cfg, MODEL, name, package, args.max_batch, args.streams, options)
        except config.ConfigError as exc:
            raise SystemExit(str(exc)) from None
        out.append(Column(name, variant, gpu_variants.write(variant, workdir / f"{name}.toml")))
    return out


def main(args: argparse.Namespace) -> int:
    progress = Progress()
    cfg_path = Path(args.config).resolve() if args.config else DEFAULT_CONFIG
    cfg = config.load(cfg_path)
    if MODEL not in cfg.models or cfg.worker.devices[0] == "cpu":
        raise SystemExit(f"{cfg_path}: the GPU bench needs a model {MODEL!r} and a GPU in worker.devices")
    s = Settings.of(args)
    from shmbroker.gpu_worker import cuda

    doc: Figures = {"schema": "shmbroker-bench-gpu/2",
                    "date": dt.datetime.now(dt.UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z"),
                    "machine": {**report.machine(), "gpu": cuda.device_name(int(cfg.worker.devices[0]))},
                    "config": {"path": str(cfg_path), "settings": config.to_dict(cfg)}, "settings": asdict(s)}
    bench = GpuBench(cfg, s, progress, args.sweep_max)
    bench.log_dir = Path(args.log_dir) if getattr(args, "log_dir", None) else None
    workdir = Path(tempfile.mkdtemp(prefix="shmbroker-bench-gpu-"))
    try:
        cols = columns(cfg, args, workdir)
        doc["engines"] = {c.engine: {"config": config.to_dict(c.cfg)["models"]} for c in cols}
        bench.run(workdir, {p.strip() for p in getattr(args, "only", ",".join(PHASES)).split(",")}, cols)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    doc["measurements"] = bench.measurements
    doc["targets"] = {e: gpu_report.targets(f, bench.measurements.get("classic"))
                      for e, f in bench.measurements["engines"].items()}
    doc["failures"] = bench.failures
    doc["elapsed_s"] = round(progress.elapsed(), 1)
    text = json.dumps(doc, indent=2) + "\n"
    human = gpu_report.table(doc)
    (sys.stderr if args.json and not args.out else sys.stdout).write(human)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
    elif args.json:
        sys.stdout.write(text)
    return 1 if bench.failures else 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="python -m shmbroker.bench.gpu", description=__doc__)
    add_arguments(ap)
    sys.exit(main(ap.parse_args()))
