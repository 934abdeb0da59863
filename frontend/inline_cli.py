"""The ``shmbroker inline`` command line; a module of its own so that the CLI imports no gateway code."""

from __future__ import annotations

import argparse
import sys

from broker import proc


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--tcp", default="", metavar="ENDPOINT",
                    help="also listen on tcp://HOST:PORT (off by default; needs --curve-secret-file)")
    ap.add_argument("--curve-secret-file", default="", metavar="FILE", help="the server's CURVE secret key (Z85)")
    ap.add_argument("--curve-clients", default="", metavar="DIR",
                    help="only the CURVE public keys in DIR (zmq.auth certificate files) may connect over TCP")
    ap.add_argument("--slots", type=int, default=0, help="ring slots, i.e. requests in flight (default: broker's)")
    ap.add_argument("--max-items", type=int, default=0,
                    help="rows per request (default: the broker's [sessions] default_max_items); callers read it "
                         "in INLINE_MODELS_REPLY")
    ap.add_argument("--log-level", default="INFO")


def command(args: argparse.Namespace) -> int:
    """``shmbroker inline``: prints ``shmbroker inline: ready on ENDPOINT[ ENDPOINT]`` once it has its session;
    exits 2 when another gateway serves the runtime directory, or there is none."""
    import uvloop

    if args.tcp and not args.curve_secret_file:
        sys.stderr.write("shmbroker: inline: --tcp: expected --curve-secret-file too (TCP needs CURVE)\n")
        return 2
    proc.name_process("shmb-inline")
    proc.setup_logging(args.log_level)

    def ready(endpoints: list[str]) -> None:
        sys.stdout.write(f"shmbroker inline: ready on {' '.join(endpoints)}\n")
        sys.stdout.flush()

    from frontend.inline import GatewayRefused, serve

    try:
        return uvloop.run(serve(args, ready))
    except GatewayRefused as exc:
        sys.stderr.write(f"shmbroker: inline: {exc}\n")
        return 2
