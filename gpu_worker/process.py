"""The worker process: a thin wrapper that names the process, ties it to the broker and runs Worker.

The broker starts it as ``python -m shmbroker.gpu_worker.process --worker-id N --runtime-dir DIR`` and writes the
validated config as JSON on its stdin, so the worker serves exactly what the broker checked.
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import sys
import threading
from pathlib import Path

import msgspec

from shmbroker.broker.common import proc
from shmbroker.broker.common.config import Config

log = logging.getLogger(__name__)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gpu_worker", description="shmbroker worker (started by the broker)")
    ap.add_argument("--worker-id", type=int, required=True)
    ap.add_argument("--runtime-dir", required=True)
    ap.add_argument("--restarts", type=int, default=0)
    args = ap.parse_args(argv)
    # a crash in native code (an engine's library, a driver) prints every thread's Python stack to stderr,
    # which is the broker's log; the broker then names the signal
    faulthandler.enable()
    proc.die_with_parent()
    parent = os.getppid()
    cfg = msgspec.json.decode(sys.stdin.buffer.read(), type=Config)
    proc.name_process(f"shmb-worker-{args.worker_id}")
    proc.setup_logging(cfg.broker.log_level)
    if cfg.worker.gil_switch_us:
        sys.setswitchinterval(cfg.worker.gil_switch_us / 1e6)
        log.info("worker %d: GIL switch interval %d us (worker.gil_switch_us)", args.worker_id,
                 round(sys.getswitchinterval() * 1e6))
    stop = threading.Event()
    proc.stop_on_signals(stop)
    if parent == 1:  # the broker died before the parent-death signal was armed
        return 1
    from shmbroker.gpu_worker.worker import Worker  # after logging: engines log while loading

    return Worker(cfg, args.worker_id, Path(args.runtime_dir), args.restarts).run(stop)


if __name__ == "__main__":
    sys.exit(main())
