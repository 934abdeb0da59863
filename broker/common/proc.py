"""Process plumbing for entry points: logging, process names, parent-death signal, stop signals."""

from __future__ import annotations

import ctypes
import functools
import logging
import signal
import sys
import threading
from types import FrameType

PR_SET_NAME = 15
PR_SET_PDEATHSIG = 1
LOG_FORMAT = "%(asctime)s %(processName)s[%(process)d] %(levelname)s %(name)s: %(message)s"


def setup_logging(level: str = "INFO") -> None:
    """Configure the root logger; called by entry points only, never at import."""
    logging.basicConfig(level=level, format=LOG_FORMAT, stream=sys.stderr, force=True)


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library this process already has loaded (no ``find_library``: it may spawn ``ldconfig``)."""
    return ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def _prctl(option: int, arg: int | bytes) -> None:
    libc = _libc()
    if libc is not None:
        libc.prctl(option, arg, 0, 0, 0)


def name_process(name: str) -> None:
    """Name this process (``ps -o comm``, ``top``) and its logging processName."""
    import multiprocessing

    multiprocessing.current_process().name = name
    _prctl(PR_SET_NAME, name.encode()[:15])


def name_thread(name: str) -> None:
    """Name the calling thread as the kernel shows it (``top -H``, ``/proc/PID/task/TID/comm``)."""
    _prctl(PR_SET_NAME, name.encode()[:15])


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Ask the kernel to send ``sig`` to this process when its parent dies."""
    _prctl(PR_SET_PDEATHSIG, int(sig))


def stop_on_signals(stop: threading.Event) -> None:
    """SIGTERM and SIGINT set ``stop``: the serving loop notices and shuts down cleanly. Signals after the
    first do nothing."""
    stopping = False

    def handler(signum: int, _frame: FrameType | None) -> None:
        # A handler runs on the main thread between any two bytecodes, so a signal that comes while an earlier
        # one's handler is inside ``stop.set()`` runs this again there, and a second ``set()`` would wait
        # forever for the Event's lock, held by the frame it interrupted. Bursts happen: a process's
        # parent-death signal comes once for each of the dead parent's threads as they exit.
        nonlocal stopping
        if stopping:
            return
        stopping = True
        logging.getLogger(__name__).info("received %s, stopping", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
