"""The engine every server of the comparison runs: the broker's config and model, loaded by the worker's loader.

A peer server reads the same config file the bench's broker serves (``--config``, ``--model``) and builds the
engine with ``gpu_worker.engines.load_engine`` from the model's own section, as the worker does. A ``Runner``
is one instance of it, for one thread at a time: on the CPU the engine's ``run``; on a GPU one stream slot's
context (CUDA graphs captured, as the worker's), fed from page-locked buffers by one copy each way per batch,
the way an application that holds the engine runs a batch.
"""

from __future__ import annotations

import argparse
import ctypes
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from shmbroker.broker.common import config
from shmbroker.gpu_worker import model_source
from shmbroker.gpu_worker.engines import Engine, is_device_engine, load_engine


def server_parser(module: str) -> argparse.ArgumentParser:
    """The options every HTTP peer server takes: the broker config and model it runs, where it listens."""
    ap = argparse.ArgumentParser(prog=f"python -m shmbroker.bench.peers.{module}")
    ap.add_argument("--config", required=True, help="the broker config whose model every server runs")
    ap.add_argument("--model", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--host", default="127.0.0.1")
    return ap


class PeerEngineError(RuntimeError):
    """The model cannot serve the comparison; the text names the config key or the model's IO at fault."""


@dataclass(frozen=True)
class ModelInfo:
    """What a server and its clients must agree on: one input and one output, their names and row shapes."""

    input_name: str
    input_shape: tuple[int, ...]  # one row, no batch dimension
    input_dtype: str
    output_name: str
    output_shape: tuple[int, ...]
    output_dtype: str
    max_batch: int
    max_queue_delay_us: int
    device: str  # "cpu" or a GPU ordinal as text

    def as_dict(self) -> dict[str, Any]:
        return {"input_name": self.input_name, "input_shape": list(self.input_shape),
                "input_dtype": self.input_dtype, "output_name": self.output_name,
                "output_shape": list(self.output_shape), "output_dtype": self.output_dtype,
                "max_batch": self.max_batch, "max_queue_delay_us": self.max_queue_delay_us, "device": self.device}


def section(cfg: config.Config, model: str) -> config.ModelSection:
    if model not in cfg.models:
        raise PeerEngineError(f"{cfg.source or 'the config'} has no [models.{model}] (--model); it has "
                              f"{sorted(cfg.models)}")
    return cfg.models[model]


def device_of(cfg: config.Config) -> str:
    """The first worker device: the one every server of the comparison runs on."""
    return str(cfg.worker.devices[0]) if cfg.worker.devices else "cpu"


def load(cfg: config.Config, model: str) -> Engine:
    """The model's engine as the worker builds it; PeerEngineError when it has other than one input and one output."""
    mc = section(cfg, model)
    engine = load_engine(mc.engine, model_source.resolve(cfg.model_path(model)), device=device_of(cfg), model=mc)
    if len(engine.inputs) != 1 or len(engine.outputs) != 1:
        engine.close()
        raise PeerEngineError(f"models.{model} has {len(engine.inputs)} inputs and {len(engine.outputs)} outputs; "
                              "the peers' raw-body protocols carry one of each")
    return engine


def info(cfg: config.Config, model: str, engine: Engine) -> ModelInfo:
    mc = section(cfg, model)
    i, o = engine.inputs[0], engine.outputs[0]
    return ModelInfo(i.name, i.item_shape, i.dtype.name, o.name, o.item_shape, o.dtype.name, mc.max_batch,
                     mc.max_queue_delay_us, device_of(cfg))


class Runner:
    """One instance of the engine on the CPU: ``run`` takes [n, *row] and returns [n, *row_out]."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._name = engine.inputs[0].name

    def run(self, x: np.ndarray) -> np.ndarray:
        out: np.ndarray = self.engine.run({self._name: x})[0]
        return out

    def close(self) -> None:
        """The engine belongs to whoever loaded it; a CPU runner holds nothing else."""


def _pinned_array(nbytes: int, dtype: np.dtype[Any], shape: tuple[int, ...]) -> tuple[int, np.ndarray]:
    from shmbroker.gpu_worker import cuda

    ptr = cuda.host_alloc_pinned(nbytes)
    buf = (ctypes.c_char * nbytes).from_address(ptr)
    return ptr, np.frombuffer(memoryview(buf).cast("B"), dtype=dtype).reshape(shape)


class DeviceRunner(Runner):
    """One stream slot of a GPU engine: its own CUDA stream and context (graphs as the worker captures them),
    page-locked input and output buffers of ``max_batch`` rows; a batch is one H2D copy, ``enqueue``, one D2H
    copy and a wait. Larger batches run in parts of ``max_batch``."""

    def __init__(self, engine: Any, index: int, max_batch: int) -> None:
        from shmbroker.gpu_worker import cuda

        super().__init__(engine)
        self.engine: Any = engine
        self._cuda = cuda
        cuda.set_device(engine.device)
        self.max_batch = max_batch
        self._stream = cuda.Stream()
        self._done = cuda.Event(blocking=True)  # a waiting server thread sleeps instead of spinning a core
        self._ctx = engine.create_context(index, self._stream.handle, max_batch)
        i, o = engine.inputs[0], engine.outputs[0]
        self._in_row, self._out_row = i.item_bytes, o.item_bytes
        self._in_ptr, self._in = _pinned_array(max_batch * i.item_bytes, i.dtype, (max_batch, *i.item_shape))
        self._out_ptr, self._out = _pinned_array(max_batch * o.item_bytes, o.dtype, (max_batch, *o.item_shape))

    def run(self, x: np.ndarray) -> np.ndarray:
        self._cuda.set_device(self.engine.device)  # per thread: servers call from threads of their own
        parts = [self._part(x[lo : lo + self.max_batch]) for lo in range(0, len(x), self.max_batch)]
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def _part(self, x: np.ndarray) -> np.ndarray:
        cuda, n, h = self._cuda, len(x), self._stream.handle
        self._in[:n] = x
        cuda.memcpy_async(self._ctx.input_ptrs[0], self._in_ptr, n * self._in_row, "h2d", h)
        self._ctx.enqueue(n)
        cuda.memcpy_async(self._out_ptr, self._ctx.output_ptrs[0], n * self._out_row, "d2h", h)
        self._done.record(self._stream)
        self._done.synchronize()
        return self._out[:n].copy()

    def close(self) -> None:
        self._ctx.close()
        self._stream.close()
        for ptr in (self._in_ptr, self._out_ptr):
            self._cuda.free_host(ptr)


def runner(engine: Engine, index: int, max_batch: int) -> Runner:
    """Instance ``index`` of ``engine``: a stream slot's context on a GPU, the engine itself on the CPU."""
    if is_device_engine(engine):
        return DeviceRunner(engine, index, max_batch)
    return Runner(engine)


def open_runners(config_path: str, model: str, instances: int) -> tuple[Engine, list[Runner], ModelInfo]:
    """Load the engine once and ``instances`` runners on it, each warmed by one max batch."""
    if instances < 1:
        raise PeerEngineError(f"instances must be at least 1, got {instances} (--instances)")
    cfg = config.load(config_path)
    engine = load(cfg, model)
    mi = info(cfg, model, engine)
    runners = [runner(engine, k, mi.max_batch) for k in range(instances)]
    x = np.zeros((mi.max_batch, *mi.input_shape), dtype=mi.input_dtype)
    for r in runners:
        r.run(x)
    return engine, runners, mi


def inputs(mi: ModelInfo, count: int, seed: int) -> np.ndarray:
    """``count`` distinct random rows of the model's input, [count, *row]."""
    rng = np.random.default_rng(seed)
    return rng.random((count, *mi.input_shape), dtype=np.float32).astype(mi.input_dtype)


def reference(r: Runner, rows: np.ndarray) -> np.ndarray:
    """Each row's output run alone (batch 1), the answer every server's reply is checked against."""
    return np.concatenate([r.run(rows[k : k + 1]) for k in range(len(rows))])


def runner_limit(r: Runner, mi: ModelInfo, sizes: list[int], seconds: float) -> dict[str, Any]:
    """Images/s of ``Runner.run`` back to back at each batch size, ``seconds`` over all: the most a server that
    runs this runner could serve, its copies included; the best size is ``best_batch``."""
    x = inputs(mi, max(sizes), seed=11)
    by_batch: dict[str, dict[str, float]] = {}
    for b in sizes:
        r.run(x[:b])
        n, t0 = 0, time.perf_counter()
        stop = t0 + seconds / len(sizes)
        while (now := time.perf_counter()) < stop or n < 3:
            r.run(x[:b])
            n += 1
        elapsed = now - t0
        by_batch[str(b)] = {"runs": n, "ms_per_batch": round(elapsed / n * 1e3, 4),
                            "items_per_s": round(n * b / elapsed, 1)}
    best = max(by_batch, key=lambda k: by_batch[k]["items_per_s"])
    return {"by_batch": by_batch, "best_batch": int(best), "items_per_s": by_batch[best]["items_per_s"]}

