"""The ``shmbroker inline`` command line; a module of its own so that the CLI imports no gateway code."""

from __future__ import annotations

import argparse
import os
import stat
import sys

from shmbroker.broker.common import proc

# Requests the gateway holds at once (frames, a slot or the wait for one): with 16 slots, enough queued behind
# them to ride out a burst, and a bound on memory of about this many times the largest request.
DEFAULT_MAX_PENDING = 256
# ... and the bytes they may hold in all (frames as received): the bound on memory whatever their size. No
# frame larger than this is ever received: ZeroMQ drops the connection that sends one (ZMQ_MAXMSGSIZE).
DEFAULT_MAX_PENDING_MIB = 512
MAX_PENDING_MIB_LIMIT = 1 << 20  # 1 TiB: far past any machine, and within ZMQ_MAXMSGSIZE's int64
CURVE_KEY_CHARS = 40  # a Z85 CURVE key
NAME = "inline"  # the subcommand (frontend/commands.py)
HELP = "the inline gateway: tensors in ZeroMQ frames, for callers without shm"


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--tcp", default="", metavar="ENDPOINT",
                    help="also listen on tcp://HOST:PORT (off by default; needs --curve-secret-file, and "
                         "--curve-clients or --curve-any-client)")
    ap.add_argument("--curve-secret-file", default="", metavar="FILE",
                    help="the server's CURVE secret key (Z85); the file must be readable by its owner only (0600)")
    ap.add_argument("--curve-clients", default="", metavar="DIR",
                    help="only the CURVE public keys in DIR (zmq.auth certificate files, *.key) may connect over "
                         "TCP; --tcp needs it or --curve-any-client")
    ap.add_argument("--curve-any-client", action="store_true",
                    help="over TCP, serve any caller that knows the server's public key, with any key pair of its "
                         "own (that public key is no secret: use only on a closed network); instead of "
                         "--curve-clients")
    ap.add_argument("--slots", type=int, default=0, help="ring slots, i.e. requests in flight (default: broker's)")
    ap.add_argument("--max-items", type=int, default=0,
                    help="rows a ring slot holds (default: the broker's [sessions] default_max_items, else as "
                         "many as default_ring_mib allows); a request of more rows, up to max_batch, is sent as "
                         "parts")
    ap.add_argument("--max-pending", type=int, default=DEFAULT_MAX_PENDING, metavar="N",
                    help="requests the gateway holds at once, in slots or waiting for one (memory: about N times "
                         "the largest request); past it a request is answered OVERLOADED at once "
                         f"(default {DEFAULT_MAX_PENDING})")
    ap.add_argument("--max-pending-mib", type=int, default=DEFAULT_MAX_PENDING_MIB, metavar="MIB",
                    help="bytes of requests the gateway holds at once, in MiB; past it a request is answered "
                         "OVERLOADED at once, and a caller that sends a frame larger than it is disconnected "
                         f"unread (default {DEFAULT_MAX_PENDING_MIB})")
    ap.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"),
                    help="logging level (default INFO)")


def tcp_refusal(args: argparse.Namespace) -> str:
    """Why the TCP options cannot be used together ('' when they can): TCP needs CURVE and a decision on who may
    connect, either the allow-list of --curve-clients or --curve-any-client, as CURVE alone serves any key pair."""
    if args.curve_clients and args.curve_any_client:
        return "--curve-clients and --curve-any-client: give one (an allow-list, or any client), not both"
    if not args.tcp:
        return "--curve-any-client: applies to --tcp only" if args.curve_any_client else ""
    if not args.curve_secret_file:
        return "--tcp: expected --curve-secret-file too (TCP needs CURVE)"
    if not (args.curve_clients or args.curve_any_client):
        return ("--tcp: expected --curve-clients DIR (the public keys of the callers that may connect) or "
                "--curve-any-client (any caller that knows the server's public key, with any key pair, is served)")
    if args.curve_clients and not os.path.isdir(args.curve_clients):
        return f"--curve-clients {args.curve_clients}: no such directory (it holds the callers' *.key files)"
    return ""


def secret_file_refusal(path: str) -> str:
    """Why the CURVE secret key file cannot be used ('' when it can): it must be a file that only its owner may
    read or write, as ssh demands of a private key, and hold a 40-character Z85 key."""
    try:
        st = os.stat(path)
        with open(path, "rb") as fh:
            key = fh.read(4096).strip()
    except OSError as exc:
        return f"--curve-secret-file {path}: cannot read it ({exc.strerror})"
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        return (f"--curve-secret-file {path}: mode {mode:04o} lets others than its owner read the server's secret "
                f"key: run `chmod 600 {path}` (and make a new key pair if others may have read it)")
    if len(key) != CURVE_KEY_CHARS:
        return (f"--curve-secret-file {path}: expected a Z85 secret key of {CURVE_KEY_CHARS} characters, got "
                f"{len(key)} (zmq.curve_keypair() makes one)")
    return ""


def command(args: argparse.Namespace) -> int:
    """``shmbroker inline``: prints ``shmbroker inline: ready on ENDPOINT[ ENDPOINT]`` once it has its session;
    exits 2 on a wrong option (naming it; --tcp without --curve-clients or --curve-any-client among them), when
    another gateway serves the runtime directory, or there is none."""
    import uvloop

    why = tcp_refusal(args)
    if why:
        sys.stderr.write(f"shmbroker: inline: {why}\n")
        return 2
    if args.curve_secret_file:
        why = secret_file_refusal(args.curve_secret_file)
        if why:
            sys.stderr.write(f"shmbroker: inline: {why}\n")
            return 2
    if args.max_pending < 1:
        sys.stderr.write(f"shmbroker: inline: --max-pending: expected at least 1, got {args.max_pending}\n")
        return 2
    if not 1 <= args.max_pending_mib <= MAX_PENDING_MIB_LIMIT:
        sys.stderr.write(f"shmbroker: inline: --max-pending-mib: expected 1 to {MAX_PENDING_MIB_LIMIT}, got "
                         f"{args.max_pending_mib}\n")
        return 2
    proc.name_process("shmb-inline")
    proc.setup_logging(args.log_level)

    def ready(endpoints: list[str]) -> None:
        sys.stdout.write(f"shmbroker inline: ready on {' '.join(endpoints)}\n")
        sys.stdout.flush()

    from shmbroker.frontend.inline import GatewayRefused, serve

    try:
        return uvloop.run(serve(args, ready))
    except GatewayRefused as exc:
        sys.stderr.write(f"shmbroker: inline: {exc}\n")
        return 2
