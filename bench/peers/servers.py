"""A peer server as a subprocess (started, waited for, stopped with its whole process tree) and the sampler that
reads its CPU time and the GPU's utilization during a measurement."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil

from shmbroker.bench import procs
from shmbroker.bench.common import BenchError

READY_POLL_S = 0.25
STOP_TIMEOUT_S = 30.0


def free_port() -> int:
    """A TCP port the kernel has free now on 127.0.0.1 (for servers that take a port number, not a socket)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def answers_200(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2.0) as r:
            return int(r.status) == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


class ServerProcess:
    """``PYTHON -m MODULE ARGS`` in its own session, its output in ``log_path``; ready once ``ready_url``
    answers 200. ``stop`` sends SIGTERM to its process group, then SIGKILL to what is left of its tree."""

    def __init__(self, name: str, module: str, args: list[str], log_path: Path, ready_url: str,
                 env: dict[str, str] | None = None, python: str = sys.executable) -> None:
        self.name, self.log_path, self.ready_url = name, log_path, ready_url
        self.startup_s: float | None = None
        self.exit_code: int | None = None
        self.killed = False
        self._log = open(log_path, "wb")  # noqa: SIM115 -- closed in stop()
        self.proc = subprocess.Popen([python, "-m", module, *args], stdout=self._log,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                                     env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})))

    def wait_ready(self, timeout_s: float) -> float:
        """Seconds until ``ready_url`` answered 200; BenchError with the log's end if the server exits first or
        the time runs out (the pause between asks is a wait on the process, so an exit is seen at once)."""
        t0 = time.monotonic()
        while not answers_200(self.ready_url):
            try:
                code = self.proc.wait(READY_POLL_S)
            except subprocess.TimeoutExpired:
                if time.monotonic() - t0 > timeout_s:
                    raise BenchError(f"{self.name} was not ready within {timeout_s:.0f} s (--ready-timeout); "
                                     f"its log ends:\n{self.log_tail()}") from None
                continue
            raise BenchError(f"{self.name} exited with code {code} before it was ready; its log ends:\n"
                             f"{self.log_tail()}")
        self.startup_s = round(time.monotonic() - t0, 2)
        return self.startup_s

    def pids(self) -> list[int]:
        """The server and every process under it (uvicorn's, LitServe's workers, tritonserver and its stubs)."""
        try:
            root = psutil.Process(self.proc.pid)
            return [root.pid, *(c.pid for c in root.children(recursive=True))]
        except psutil.Error:
            return []

    def stop(self) -> int | None:
        """SIGTERM to the process group; what is still alive ``STOP_TIMEOUT_S`` later (the server, or a process
        of its tree that left the group) gets SIGKILL, and ``killed`` says so."""
        if self.proc.poll() is None:
            tree = []  # Process objects, taken now: psutil refuses to signal a pid that was reused since
            for pid in self.pids()[1:]:
                with contextlib.suppress(psutil.Error):
                    tree.append(psutil.Process(pid))
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            t0 = time.monotonic()
            self.killed = procs.wait_or_kill(self.proc, STOP_TIMEOUT_S)
            _, alive = psutil.wait_procs(tree, timeout=max(1.0, STOP_TIMEOUT_S - (time.monotonic() - t0)))
            for p in alive:
                with contextlib.suppress(psutil.Error):
                    p.kill()
                    self.killed = True
        self.exit_code = self.proc.returncode
        self._log.close()
        return self.exit_code

    def log_tail(self, chars: int = 3000) -> str:
        if not self._log.closed:
            self._log.flush()
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"


class Sampler(threading.Thread):
    """Every ``period_s``: the CPU seconds of the processes under ``roots`` and, when ``gpu`` is an ordinal, the
    GPU's utilization (NVML), each with its monotonic time."""

    def __init__(self, roots: list[int], gpu: int | None, period_s: float = 0.1) -> None:
        super().__init__(name="bench-peers-sampler", daemon=True)
        self.roots, self.gpu, self.period_s = roots, gpu, period_s
        self.cpu: list[tuple[float, float]] = []
        self.util: list[tuple[float, float]] = []
        self.error: str | None = None
        self._stop_event = threading.Event()
        self.first = threading.Event()  # set once the first readings are in: a window after it is covered
        self._cache: dict[int, psutil.Process] = {}

    def run(self) -> None:
        nvml, handle = None, None
        if self.gpu is not None:
            try:
                import pynvml

                pynvml.nvmlInit()
                nvml, handle = pynvml, pynvml.nvmlDeviceGetHandleByIndex(self.gpu)
            except Exception as exc:  # noqa: BLE001 - no NVML: GPU busy is reported missing, with why
                self.error = f"NVML unavailable: {type(exc).__name__}: {exc}"
        try:
            stopping = False
            while not stopping:
                stopping = self._stop_event.is_set()  # one reading more after stop(): past the last window's end
                now = time.monotonic()
                self.cpu.append((now, procs.tree_cpu_s(self.roots, self._cache)))
                if nvml is not None:
                    self.util.append((now, float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)))
                self.first.set()
                if not stopping:
                    self._stop_event.wait(self.period_s)
        finally:
            self.first.set()  # also when a reading failed: nobody waits for a sampler that has ended
            if nvml is not None:
                nvml.nvmlShutdown()

    def stop(self) -> None:
        self._stop_event.set()
        self.join(10.0)


def gpu_name(ordinal: int) -> str:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(ordinal))
        finally:
            pynvml.nvmlShutdown()
    except Exception as exc:  # noqa: BLE001 - the name is information; say why it is missing
        return f"(unknown GPU {ordinal}: {type(exc).__name__})"
    return name.decode() if isinstance(name, bytes) else str(name)
