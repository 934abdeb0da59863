"""``shmbroker bench --photos`` (or ``python -m shmbroker.bench.photos``): photos in, scores out, against the
in-process limit of the same decode and engine and against clients that decode with Pillow, in one run.

For each photo size of the set (bench/photoset.py): (a) the in-process limit of the worker's own photo runner
(bench/photo_inprocess.py: decode + preprocess + engine, the sweep's best shape and batch), (b) the broker with
client processes sending the photos' encoded bytes to the photo model, in interleaved rounds with (a)
(bench/paired.py), then (c) the same client processes decoding and preprocessing with Pillow and sending float32 to
the tensor model. The worker's device is the config's (``worker.devices``); on a GPU, NVML's utilization is
sampled. bench/README.md says what each figure means.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil

from shmbroker.bench import gpu_load, paired, photo_cload, photo_load, photo_report, photoset, report
from shmbroker.bench.broker_proc import BrokerProcess
from shmbroker.bench.common import BenchError, Figures, Progress
from shmbroker.bench.photo_inprocess import Limit
from shmbroker.bench.procs import Target, run_group, spawn_context
from shmbroker.broker.common import config

PHOTO_MODEL = "nsfw_photo"
TENSOR_MODEL = "nsfw"
BATCH_SIZES = (1, 4, 8, 16, 32, 64, 128, 256)  # (a)'s sweep, capped at the photo model's max_batch
ROUND_TIMEOUT_S = 300.0  # one wait on the rounds' barrier: (a)'s window, or (b)'s window and its drain


@dataclass(frozen=True)
class Settings:
    quick: bool
    duration_s: float  # each window of (a), (b) and (c)
    warmup_s: float  # the clients run, uncounted, before each window
    sweep_s: float  # (a)'s sweep, per shape and batch size
    rounds: int  # interleaved rounds of (a) and (b)
    processes: int
    in_flight: int  # per client process
    sizes: tuple[str, ...]
    client_spin_us: int = 1000  # the clients' Client(spin_us=): the library's default
    photos_per_request: int = 1  # (b)'s requests: one photo, or a list of this many
    c_client: str = ""  # examples/c's binary: (b') with it, where given
    photo_model: str = PHOTO_MODEL
    tensor_model: str = TENSOR_MODEL

    @classmethod
    def of(cls, args: argparse.Namespace, gpu: bool) -> Settings:
        """From the command line; without ``--processes``/``--in-flight``/``--photos-per-request``: on a GPU
        worker 16 processes x 4 requests of 32 photos (16 of bench/gpu_photos.toml's batches of 128 in flight;
        a list costs its client one wake-up, bench/RESULTS.md#batches-by-session-on-an-h100), on a CPU one 4 x 4
        of one photo (its engine takes two batches of 8 at once: 16 in flight keep one more queued)."""
        quick = bool(args.quick)
        duration = args.duration if args.duration is not None else (2.0 if quick else 5.0)
        rounds = args.rounds if args.rounds is not None else (1 if quick else 3)
        if rounds < 1:
            raise BenchError(f"--rounds must be at least 1, got {rounds}")
        sizes = photoset.parse_sizes(args.sizes) if args.sizes else list(photoset.SIZES)
        processes = args.processes if args.processes is not None else (16 if gpu else 4)
        in_flight = args.in_flight if args.in_flight is not None else 4
        if args.client_spin_us < 0:
            raise BenchError(f"--client-spin-us must be 0 or more, got {args.client_spin_us}")
        c_client = photo_cload.check_binary(args.c_client) if getattr(args, "c_client", None) else ""
        per_request = getattr(args, "photos_per_request", None)
        per_request = per_request if per_request is not None else (32 if gpu else 1)
        if per_request < 1:
            raise BenchError(f"--photos-per-request must be at least 1, got {per_request}")
        return cls(quick, duration, 0.5 if quick else 1.0, duration / 2 if quick else duration, rounds, processes,
                   in_flight, tuple(photoset.size_name(s) for s in sizes), args.client_spin_us,
                   photos_per_request=per_request, c_client=c_client)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """``python -m shmbroker.bench.photos``'s options; ``shmbroker bench --photos`` takes the same (bench/run.py)."""
    ap.add_argument("--json", action="store_true", help="JSON on stdout (the table then goes to stderr)")
    ap.add_argument("--out", default=None, metavar="FILE", help="write the JSON document to FILE")
    ap.add_argument("--quick", action="store_true", help="2 s windows, one round")
    ap.add_argument("--config", default=None, metavar="PATH",
                    help=f"broker config (default configs/default.toml); it needs {PHOTO_MODEL!r} (and "
                         f"{TENSOR_MODEL!r} for (c))")
    ap.add_argument("--duration", type=float, default=None, metavar="SECONDS", help="each window (default 5)")
    ap.add_argument("--rounds", type=int, default=None, metavar="N",
                    help="interleaved rounds of (a) and (b) (default 3, 1 with --quick)")
    photoset.add_arguments(ap)
    ap.add_argument("--processes", type=int, default=None,
                    help="client processes in (b) and (c) (default 16 on a GPU worker, 4 on a CPU one)")
    ap.add_argument("--in-flight", type=int, default=None,
                    help="requests each client keeps in flight (default 4)")
    ap.add_argument("--client-spin-us", type=int, default=1000, metavar="US",
                    help="each client's spin_us (default 1000, the client's own; 0: wait in the kernel at once)")
    ap.add_argument("--photos-per-request", type=int, default=None, metavar="K",
                    help="photos in each of (b)'s requests (default 32 on a GPU worker, 1 on a CPU one; at most "
                         "the photo model's max_batch a slot): its figures stay per photo, its latencies per "
                         "request")
    ap.add_argument("--c-client", default=None, metavar="BINARY",
                    help="examples/c's shmb_client (make -C examples/c OUT=DIR): adds (b'), the same load from C "
                         "client processes")


def _device(cfg: config.Config) -> int | None:
    dev = cfg.worker.devices[0]
    return None if dev == "cpu" else int(dev)


class PhotoBench:
    def __init__(self, cfg: config.Config, cfg_path: Path, s: Settings, progress: Progress) -> None:
        self.cfg, self.cfg_path, self.s, self.progress = cfg, cfg_path, s, progress
        self.device = _device(cfg)
        self.measurements: dict[str, Figures] = {}
        self.failures: list[str] = []
        self.decoder = "-"

    def phase(self, into: Figures, key: str, title: str, fn: Callable[[], Figures],
              summary: Callable[[Figures], str]) -> None:
        """Measure ``fn`` into ``into[key]``; a BenchError is that measurement's error and a failure of the run."""
        self.progress.phase(title)
        psutil.cpu_percent(None)
        try:
            figures = fn()
        except BenchError as exc:
            into[key] = {"error": str(exc)}
            self.failures.append(f"{title}: {exc}")
            self.progress.note(f"FAILED: {exc}")
            return
        figures["machine_cpu_busy_pct"] = psutil.cpu_percent(None)
        into[key] = figures
        self.progress.done(summary(figures))

    def run(self, workdir: Path, sets: dict[str, photoset.PhotoSet]) -> Figures:
        """Every size's (a), (b) and (c); the broker's shutdown figures."""
        s = self.s
        self.progress.phase(f"loading {s.photo_model!r} in-process as the worker builds it")
        limit = Limit(self.cfg, s.photo_model)
        self.decoder = limit.decoder
        self.progress.done(f"{', '.join(sh.name for sh in limit.shapes)}; decoder {limit.decoder}")
        broker = BrokerProcess(self.cfg_path, workdir, self.progress)
        try:
            self.progress.phase(f"starting the broker ({self.cfg_path})")
            with limit, broker:
                self.progress.done(f"ready in {broker.startup_s:.1f} s")
                for name in s.sizes:
                    self._size(name, sets[name], limit, broker)
        finally:
            broker.stop()
        shutdown = broker.shutdown_figures()
        if not shutdown["shm_clean"]:
            self.failures.append(f"broker shutdown not clean: {shutdown}")
        return shutdown

    def _size(self, name: str, photos: photoset.PhotoSet, limit: Limit, broker: BrokerProcess) -> None:
        s = self.s
        m: Figures = self.measurements.setdefault(name, {})
        images = [memoryview(b) for b in photos.load()]
        sizes = limit.batch_sizes(BATCH_SIZES)
        self.phase(m, "inprocess_sweep", f"{name}: (a) sweep, in-process decode + engine, batches {sizes}, "
                   f"{s.sweep_s:g} s each", lambda: limit.sweep(images, sizes, s.sweep_s, self.progress),
                   lambda f: f"{f['items_per_s']:.1f} photos/s, {f['best_shape']}, batch {f['best_batch']}")
        if "error" in m["inprocess_sweep"]:
            return
        paths = [str(p) for p in photos.paths]
        self._rounds(name, m, limit, images, broker, paths)
        if s.c_client:
            self.phase(m, "cclients", f"{name}: (b') broker, {s.processes} C client processes x {s.in_flight} slots",
                       lambda: self.c_clients(broker, paths), _summary)
        if s.tensor_model in self.cfg.models:
            preset = self.cfg.models[s.photo_model].preprocess
            self.phase(m, "pillow", f"{name}: (c) broker, {s.processes} procs x {s.in_flight} threads decoding with "
                       f"Pillow, float32 to {s.tensor_model!r}",
                       lambda: self.clients(broker, photo_load.pillow_client, s.tensor_model, paths, preset), _summary)
        else:
            m["pillow"] = {"error": f"skipped: the config has no model {s.tensor_model!r}"}
            self.failures.append(f"{name} (c): the config has no model {s.tensor_model!r}")

    def _rounds(self, name: str, m: Figures, limit: Limit, images: list[memoryview], broker: BrokerProcess,
                paths: list[str]) -> None:
        """(a) and (b) in interleaved rounds, a b a b ... a (bench/paired.py), one set of client processes running
        all of (b)'s windows: they wait on a round barrier while this process runs (a), so each (b) window sits
        right between its two (a) windows, with no process start between them."""
        s = self.s
        model = s.photo_model
        barrier = spawn_context().Barrier(s.processes + 1)
        specs = [{**spec, "rounds": s.rounds, "round_barrier": barrier, "round_timeout_s": ROUND_TIMEOUT_S}
                 for spec in self._specs(broker, model, paths)]
        sampler = gpu_load.Sampler(self.device, broker.runtime_dir)
        busy: list[float] = []
        b_title = f"{name}: (b) broker, {s.processes} procs x {s.in_flight} encoded photos in flight"
        pair = paired.Pair(
            paired.Side("inprocess", f"{name}: (a) in-process limit, {s.duration_s:g} s",
                        lambda: limit.measure(images, s.duration_s), lambda f: f"{f['per_s']:.1f} photos/s"),
            paired.Side("broker", b_title, dict, _summary),  # its windows come from the clients' rounds below
            ("per_s",))

        def baseline(r: int) -> None:
            a = pair.base
            self.phase(m, paired.window_key(a.key, r), f"{a.title} (window {r + 1} of {s.rounds + 1})", a.measure,
                       a.summary)

        def watch() -> None:
            try:
                barrier.wait(ROUND_TIMEOUT_S)  # every client is ready
                for r in range(s.rounds):
                    baseline(r)
                    self.progress.phase(f"{b_title} (window {r + 1} of {s.rounds})")
                    barrier.wait(ROUND_TIMEOUT_S)
                    psutil.cpu_percent(None)
                    barrier.wait(ROUND_TIMEOUT_S)
                    busy.append(psutil.cpu_percent(None))
                baseline(s.rounds)
            except threading.BrokenBarrierError:  # a client failed: run_group reports it
                return

        watcher = threading.Thread(target=watch, name="bench-rounds", daemon=True)
        sampler.start()
        watcher.start()
        try:
            results = run_group(self.progress, photo_load.encoded_rounds_client, specs,
                                expect_s=s.rounds * (s.warmup_s + 2 * s.duration_s + 5.0) + s.duration_s)
            watcher.join(s.duration_s * 3 + 60.0)
        except BenchError as exc:
            self.failures.append(f"{b_title}: {exc}")
            self.progress.note(f"FAILED: {exc}")
            results = []
        finally:
            barrier.abort()
            watcher.join(10.0)
            sampler.stop()
        for r in range(s.rounds):
            key = paired.window_key("broker", r)
            if not results:
                m[key] = {"error": "the client processes failed (see failures)"}
                continue
            f = per_photo(self._figures(gpu_load.merge([res["rounds"][r] for res in results], s.duration_s,
                                                       sampler), model, sampler), s.photos_per_request)
            f["machine_cpu_busy_pct"] = busy[r] if r < len(busy) else None
            m[key] = f
            self.progress.note(f"(b) window {r + 1}: {_summary(f)}")
        paired.merge(m, pair, s.rounds)

    def _specs(self, broker: BrokerProcess, model: str, paths: list[str], preset: str = "") -> list[dict[str, Any]]:
        s = self.s
        return [{"index": i, "processes": s.processes, "seed": 100 + i, "runtime_dir": str(broker.runtime_dir),
                 "model": model, "paths": paths, "preset": preset, "in_flight": s.in_flight, "warmup_s": s.warmup_s,
                 "duration_s": s.duration_s, "warmup_requests": 4, "spin_us": s.client_spin_us,
                 "photos_per_request": s.photos_per_request}
                for i in range(s.processes)]

    def clients(self, broker: BrokerProcess, target: Target, model: str, paths: list[str],
                preset: str = "") -> Figures:
        """One window of client processes running ``target`` on ``model``, with the worker's CPU time and batches
        from the broker's stats inside it."""
        s = self.s
        sampler = gpu_load.Sampler(self.device, broker.runtime_dir)
        out = gpu_load.group(self.progress, target, self._specs(broker, model, paths, preset), sampler, s.warmup_s,
                             s.duration_s)
        return self._figures(out, model, sampler)

    def c_clients(self, broker: BrokerProcess, paths: list[str]) -> Figures:
        """(b') One window of examples/c's client processes on the photo model (bench/photo_cload.py)."""
        s = self.s
        sampler = gpu_load.Sampler(self.device, broker.runtime_dir)
        sampler.start()
        try:
            out = photo_cload.run(s.c_client, broker.runtime_dir, s.photo_model, paths, s.processes, s.in_flight,
                                  s.duration_s)
        finally:
            sampler.stop()
        out["gpu_busy_pct"], out["gpu_busy_error"] = sampler.busy_pct(*out["window_monotonic"]), sampler.error
        return self._figures(out, s.photo_model, sampler)

    def _figures(self, out: Figures, model: str, sampler: gpu_load.Sampler) -> Figures:
        """A window's figures per photo: the clients' CPU, where the decoder ran, and the worker's CPU time and
        batches from the broker's stats inside the window."""
        out["client_cpu_us_per_image"] = out.pop("client_cpu_us_per_request")
        out["decoder"] = self.decoder if model == self.s.photo_model else "client:Pillow"
        window = sampler.stats_window(*out["window_monotonic"])
        if window is None:
            out["worker_cpu_us_per_image"] = None
            return out
        before, after = window
        stages = gpu_load.stage_figures(before.stats, after.stats, model, after.t - before.t)
        out["batches"], out["mean_batch"] = stages.get("batches"), stages.get("mean_batch")
        out["stages"] = stages  # where a photo's time goes in the worker: gpu_load.WORKER_STAGES
        by_worker = gpu_load.worker_cpu(before, after, model, per="row")  # a request may carry several photos
        out["worker_cpu_us_by_thread"] = by_worker
        totals = [w["total"] for w in by_worker.values() if isinstance(w, dict) and "total" in w]
        out["worker_cpu_us_per_image"] = round(sum(totals), 1) if totals else None
        return out


def per_photo(f: Figures, k: int) -> Figures:
    """A (b) window whose requests carried ``k`` photos each, per photo: its rate, count and the clients' CPU
    figures scaled by ``k`` (the worker's are per row already); its latencies stay per request, and
    ``photos_per_request`` says so."""
    f["photos_per_request"] = k
    if k == 1:
        return f
    for key in ("per_s", "completed"):
        if isinstance(f.get(key), int | float):
            f[key] = round(f[key] * k, 1)
    if isinstance(f.get("client_cpu_us_per_image"), int | float):
        f["client_cpu_us_per_image"] = round(f["client_cpu_us_per_image"] / k, 2)
    f["client_cpu_us_by_thread"] = {t: round(v / k, 2) for t, v in (f.get("client_cpu_us_by_thread") or {}).items()}
    return f


def _summary(f: Figures) -> str:
    lat = f.get("latency", {})
    return (f"{f['per_s']:,.1f} photos/s, p50 {lat.get('p50_us', 0) / 1e3:.1f} ms, p99 {lat.get('p99_us', 0) / 1e3:.1f}"
            f" ms, client {f.get('client_cpu_us_per_image')} us/photo, worker {f.get('worker_cpu_us_per_image')} "
            f"us/photo, {f['errors']} errors")


def _now_iso() -> str:
    return dt.datetime.now(dt.UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def main(args: argparse.Namespace) -> int:
    progress = Progress()
    cfg_path = Path(args.config).resolve() if args.config else config.DEFAULT_CONFIG
    cfg = config.load(cfg_path)
    device = _device(cfg)
    try:
        s = Settings.of(args, gpu=device is not None)
    except BenchError as exc:
        sys.stderr.write(f"shmbroker bench --photos: {exc}\n")
        return 2
    if s.photo_model not in cfg.models or cfg.models[s.photo_model].input != "image":
        sys.stderr.write(f"shmbroker bench --photos: {cfg_path} has no model {s.photo_model!r} of input = \"image\" "
                         "(configs/default.toml has one)\n")
        return 2
    machine = {**report.machine(), "background_cpu_busy_pct": psutil.cpu_percent(1.0)}
    if device is not None:
        from shmbroker.gpu_worker import cuda

        machine["gpu"] = cuda.device_name(device)
    doc: Figures = {"schema": "shmbroker-bench-photos/1", "date": _now_iso(), "machine": machine,
                    "config": {"path": str(cfg_path), "settings": config.to_dict(cfg)}, "settings": asdict(s)}
    bench = PhotoBench(cfg, cfg_path, s, progress)
    workdir = Path(tempfile.mkdtemp(prefix="shmbroker-bench-photos-"))
    try:
        progress.phase("the photo set")
        sets = photoset.build(photoset.parse_sizes(",".join(s.sizes)),
                              Path(args.photo_cache) if args.photo_cache else None, progress)
        named = {photoset.size_name(k): v for k, v in sets.items()}
        doc["photoset"] = {k: v.figures() for k, v in named.items()}
        progress.done(", ".join(f"{k}: {v['images']} photos, mean {v['mean_bytes']:,} bytes"
                                for k, v in doc["photoset"].items()))
        doc["broker"] = bench.run(workdir, named)
    except BenchError as exc:
        bench.failures.append(str(exc))
        progress.note(f"FAILED: {exc}")
    except KeyboardInterrupt:
        bench.failures.append("interrupted")
        progress.note("interrupted; the broker and the client processes were stopped")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    doc["decoder"] = bench.decoder
    doc["measurements"] = bench.measurements
    doc["ratios"] = {name: photo_report.ratios(m) for name, m in bench.measurements.items()}
    doc["targets"] = {name: photo_report.targets(r, gpu=device is not None) for name, r in doc["ratios"].items()}
    doc["failures"] = bench.failures
    doc["machine"]["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    doc["elapsed_s"] = round(progress.elapsed(), 1)
    return _emit(doc, args)


def _emit(doc: Figures, args: Any) -> int:
    text = json.dumps(doc, indent=2) + "\n"
    human = photo_report.table(doc)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
    (sys.stderr if args.json and not args.out else sys.stdout).write(human)
    if args.json and not args.out:
        sys.stdout.write(text)
    return 1 if doc["failures"] else 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="python -m shmbroker.bench.photos", description=__doc__)
    add_arguments(ap)
    sys.exit(main(ap.parse_args()))
