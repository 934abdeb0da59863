"""PyTriton: Triton Inference Server's C++ core and its dynamic batcher, the model in this Python process.

As PyTriton's docs advise for throughput: the inference callable takes whole batches (``@batch``), the model is
bound with ``ModelConfig(max_batch_size=, batcher=DynamicBatcher(max_queue_delay_microseconds=))`` so that
Triton's dynamic batcher forms them, and a list of callables, one per engine instance, gives Triton that many
model instances (each its own stream slot on a GPU). Triton serves HTTP and gRPC (KServe v2); requests reach
this process through PyTriton's proxy over shared memory. ``max_batch_size`` and the delay are the broker's
``max_batch`` and ``max_queue_delay_us`` for the same model.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from shmbroker.bench.peers import engine as E

NUMPY_BELOW = 2  # PyTriton 0.7 pins numpy < 2, and means it


def infer_function(runner: E.Runner, input_name: str, output_name: str) -> Callable[..., Any]:
    """One model instance: Triton's batch of ``input_name`` rows through ``runner``."""
    from pytriton.decorators import batch

    @batch  # type: ignore[untyped-decorator]
    def infer(**inputs: np.ndarray) -> dict[str, np.ndarray]:
        return {output_name: runner.run(inputs[input_name])}

    return infer  # type: ignore[no-any-return]


def main(argv: list[str] | None = None) -> int:
    from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
    from pytriton.triton import Triton, TritonConfig

    ap = argparse.ArgumentParser(prog="python -m shmbroker.bench.peers.pytriton_peer")
    ap.add_argument("--config", required=True, help="the broker config whose model every server runs")
    ap.add_argument("--model", required=True)
    ap.add_argument("--http-port", type=int, required=True)
    ap.add_argument("--grpc-port", type=int, required=True)
    ap.add_argument("--metrics-port", type=int, required=True)
    ap.add_argument("--instances", type=int, default=1, help="model instances, each an engine instance")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="pytriton-peer %(levelname)s %(message)s")
    if int(np.__version__.split(".")[0]) >= NUMPY_BELOW:
        print(f"pytriton-peer: numpy {np.__version__} at {np.__file__}: PyTriton's Triton Python backend stub reads "
              f"arrays by numpy 1's layout and answers empty tensors under numpy {NUMPY_BELOW}; put a numpy 1 first "
              "for this server and its Triton stubs (PEERS_PYTRITON_NUMPY, bench/peers/run.py)", file=sys.stderr)
        return 2
    _engine, runners, mi = E.open_runners(args.config, args.model, args.instances)
    tconfig = TritonConfig(http_address="127.0.0.1", http_port=args.http_port, grpc_address="127.0.0.1",
                           grpc_port=args.grpc_port, metrics_port=args.metrics_port, log_verbose=0)
    with Triton(config=tconfig) as triton:
        triton.bind(
            model_name=args.model,
            infer_func=[infer_function(r, mi.input_name, mi.output_name) for r in runners],
            inputs=[Tensor(name=mi.input_name, dtype=np.dtype(mi.input_dtype).type, shape=mi.input_shape)],
            outputs=[Tensor(name=mi.output_name, dtype=np.dtype(mi.output_dtype).type, shape=mi.output_shape)],
            config=ModelConfig(max_batch_size=mi.max_batch,
                               batcher=DynamicBatcher(max_queue_delay_microseconds=mi.max_queue_delay_us)),
            strict=False,
        )
        triton.serve()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
