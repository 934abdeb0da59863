"""LitServe with its own batching, as its docs advise for throughput.

``LitAPI(max_batch_size=, batch_timeout=)`` with ``batch``/``unbatch``, ``LitServer(workers_per_device=N,
fast_queue=True)`` (ZeroMQ between the HTTP servers and the inference workers, advised past 100 requests/s)
and ``num_api_servers`` left to LitServe (one HTTP server process per inference worker, its recommendation).
Each inference worker process loads the engine for itself in ``setup``. The request body is one row's raw
bytes (FastAPI reads a ``bytes`` body as is), the answer the output row's raw bytes. ``max_batch_size`` and
``batch_timeout`` are the broker's ``max_batch`` and ``max_queue_delay_us`` for the same model.

No ``from __future__ import annotations`` here: LitServe hands ``decode_request``'s annotation to FastAPI as an
object, and a string would not resolve in LitServe's module.
"""

import logging
from typing import Annotated, Any

import litserve as ls
import numpy as np
from fastapi import Body, Response

from shmbroker.bench.peers import engine as E

RawBody = Annotated[bytes, Body(media_type="application/octet-stream")]


class EngineAPI(ls.LitAPI):  # type: ignore[misc]
    """One inference worker: the engine with one instance, batches of LitServe's making."""

    def __init__(self, config_path: str, model: str, max_batch: int, batch_timeout_s: float) -> None:
        super().__init__(max_batch_size=max_batch, batch_timeout=batch_timeout_s, api_path="/predict")
        self.config_path, self.model = config_path, model

    def setup(self, device: str) -> None:
        self._engine, runners, self.mi = E.open_runners(self.config_path, self.model, 1)
        self.runner = runners[0]

    def decode_request(self, request: RawBody) -> np.ndarray:
        return np.frombuffer(request, dtype=self.mi.input_dtype).reshape(self.mi.input_shape)

    def batch(self, inputs: list[np.ndarray]) -> np.ndarray:
        return np.stack(inputs)

    def predict(self, x: np.ndarray) -> np.ndarray:
        return self.runner.run(x)

    def unbatch(self, output: np.ndarray) -> list[np.ndarray]:
        return list(output)

    def encode_response(self, output: np.ndarray) -> Response:
        return Response(content=output.tobytes(), media_type="application/octet-stream")


def main(argv: list[str] | None = None) -> int:
    from shmbroker.broker.common import config

    ap = E.server_parser("litserve_peer")
    ap.add_argument("--workers", type=int, default=1, help="inference worker processes on the device "
                                                           "(workers_per_device)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="litserve-peer %(levelname)s %(message)s")
    mc = E.section(config.load(args.config), args.model)
    device = E.device_of(config.load(args.config))
    api = EngineAPI(args.config, args.model, mc.max_batch, mc.max_queue_delay_us / 1e6)
    server: Any = ls.LitServer(api, accelerator="cpu" if device == "cpu" else "cuda", devices=1,
                               workers_per_device=args.workers, timeout=60, fast_queue=True)
    server.run(host=args.host, port=args.port, log_level="warning", generate_client_file=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
