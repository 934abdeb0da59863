"""The prober process (``shmb-prober``): a ring client of the broker that runs a one-row dummy inference per
model at an interval, through the real data path, and writes each result to its stdout as one JSON line
(``protocol.ProbeResult``), which the broker's ``Prober`` reads (broker/ops/probe.py). A process of its own so
that the broker never loads the client library; it ends with the broker (``die_with_parent``), on SIGTERM, or
once its stdout is closed.
"""

from __future__ import annotations

import argparse
import functools
import io
import logging
import sys
import threading

import msgspec
import numpy as np

from shmbroker.broker.common import proc
from shmbroker.broker.common import protocol as P
from shmbroker.client import Client, ShmBrokerError

log = logging.getLogger(__name__)

RETRY_S = 0.5  # wait before a new session when the last one could not be made


class ProbeLoop:
    """Probes ``models`` every ``interval_s`` with a ``timeout_s`` deadline each; ``report`` gets every result."""

    def __init__(self, runtime_dir: str, models: list[str], interval_s: float, timeout_s: float,
                 stop: threading.Event) -> None:
        self.runtime_dir, self.models = runtime_dir, models
        self.interval_s, self.timeout_s, self.stop = interval_s, timeout_s, stop

    def report(self, model: str, error: str) -> None:
        sys.stdout.buffer.write(msgspec.json.encode(P.ProbeResult(model, error)) + b"\n")
        sys.stdout.buffer.flush()

    def run(self) -> None:
        client: Client | None = None
        try:
            while not self.stop.is_set():
                if client is None:
                    try:
                        client = Client(self.runtime_dir, slots=2, max_items=1, connect_timeout=self.timeout_s,
                                        name="shmb-prober", spin_us=0)
                    except Exception as exc:  # noqa: BLE001 - any failure to open a session fails the probes
                        log.warning("the prober could not open a session: %s: %s", type(exc).__name__, exc)
                        for m in self.models:
                            self.report(m, f"the prober could not open a session: {exc}")
                        self.stop.wait(RETRY_S)
                        continue
                for m in self.models:
                    self.report(m, self._probe(client, m))
                self.stop.wait(self.interval_s)
        finally:
            if client is not None:
                client.close()

    def _probe(self, client: Client, model: str) -> str:
        """'' when the probe passed, else why not."""
        plan = client.models.get(model)
        if plan is None:
            return f"the broker's session does not list model {model!r}"
        feeds: object = probe_image() if plan.image_max_bytes else {
            s.name: np.zeros((1, *shape), dt)
            for s, shape, dt in zip(plan.info.inputs, plan.in_item_shapes, plan.in_dtypes, strict=True)}
        try:
            client.infer(model, feeds, timeout=self.timeout_s)  # type: ignore[arg-type]
        except ShmBrokerError as exc:
            log.warning("health probe of model %s failed: %s: %s", model, type(exc).__name__, exc)
            return f"probe failed: {type(exc).__name__}: {exc}"
        return ""


@functools.cache
def probe_image() -> bytes:
    """A small grey JPEG: a model of images is probed with an image its worker must decode."""
    from PIL import Image

    with io.BytesIO() as buf:
        Image.new("RGB", (64, 64), (128, 128, 128)).save(buf, format="JPEG")
        return buf.getvalue()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m shmbroker.broker.ops.prober_process")
    ap.add_argument("--runtime-dir", required=True)
    ap.add_argument("--interval", type=float, required=True, help="seconds between rounds")
    ap.add_argument("--timeout", type=float, required=True, help="each probe's deadline, seconds")
    ap.add_argument("--log-level", default="INFO")
    ap.add_argument("models", nargs="+")
    args = ap.parse_args(argv)
    proc.die_with_parent()
    proc.name_process("shmb-prober")
    proc.setup_logging(args.log_level)
    stop = threading.Event()
    proc.stop_on_signals(stop)
    try:
        ProbeLoop(args.runtime_dir, args.models, args.interval, args.timeout, stop).run()
    except BrokenPipeError:  # the broker closed our stdout: it no longer reads
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
