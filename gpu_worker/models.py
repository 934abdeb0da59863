"""The models a worker serves: loading, checking and warming them up (``build_models``), and how they are
described to the broker (``model_info``) and named in an OVERLOADED answer (``overloaded_message``)."""

from __future__ import annotations

import logging
import time
from typing import cast

import numpy as np

from shmbroker.broker.common import imaging
from shmbroker.broker.common import protocol as P
from shmbroker.broker.common.config import Config, ModelSection
from shmbroker.gpu_worker import cuda, model_source
from shmbroker.gpu_worker.batcher import Batcher
from shmbroker.gpu_worker.batching import BatchPolicy
from shmbroker.gpu_worker.devicephotos import DevicePhotoRunner
from shmbroker.gpu_worker.engines import DeviceEngine, Engine, IOSpec, is_device_engine, load_engine
from shmbroker.gpu_worker.engines.base import EngineError
from shmbroker.gpu_worker.intake import ModelView, Photos
from shmbroker.gpu_worker.photorunner import PhotoRunner
from shmbroker.gpu_worker.photos import Preprocessor, make_decoder
from shmbroker.gpu_worker.pipeline import PipelineRunner
from shmbroker.gpu_worker.runner import BatchRunner, ModelRunner, Progress, quiet
from shmbroker.gpu_worker.warmup import prime
from shmbroker.gpu_worker.work import ModelCounters, Work

log = logging.getLogger(__name__)


class ServedModel:
    def __init__(self, view: ModelView, engine: Engine, runner: BatchRunner) -> None:
        self.view = view
        self.engine = engine
        self.runner = runner


def build_models(cfg: Config, device: str, progress: Progress = quiet) -> dict[int, ServedModel]:
    """Load, check and warm up every configured model, telling ``progress`` each step (``model NAME (K of N):
    STEP``); EngineError names the model that failed.

    On a GPU worker (``device`` an ordinal) the calling thread selects that device first: it is the IO
    thread, which later unregisters rings; the pipeline's own threads select it themselves.
    """
    if device != "cpu":
        cuda.set_device(int(device))
    served: dict[int, ServedModel] = {}
    for model_id, (name, mc) in enumerate(cfg.models.items()):
        t0 = time.monotonic()
        step = _steps(progress, f"model {name} ({model_id + 1} of {len(cfg.models)})")
        step(f"loading its {mc.engine} engine")
        engine = load_engine(mc.engine, model_source.resolve(cfg.model_path(name)), device=device, model=mc)
        view = model_view(model_id, name, mc, engine)
        lone = lone_engine(cfg, name)
        batcher: Batcher[Work] = Batcher(BatchPolicy.from_config(mc, device=is_device_engine(engine)))
        step("building its photo stage" if view.photos is not None else "building its runner")
        if view.photos is not None:
            runner: BatchRunner = photo_runner(view, engine, batcher, mc, lone)
        else:
            runner = make_runner(view, engine, batcher, mc.streams, mc.instances, lone)
        if mc.warmup:
            prime(runner, step)
        served[model_id] = ServedModel(view, engine, runner)
        log.info("model %s ready on %s in %.2f s", name, device, time.monotonic() - t0)
    return served


def _steps(progress: Progress, model: str) -> Progress:
    return lambda step: progress(f"{model}: {step}")


def model_view(model_id: int, name: str, mc: ModelSection, engine: Engine) -> ModelView:
    """The model as intake sees it: the engine's inputs, or the images or frames its preset turns into them."""
    if mc.input == P.InputKind.TENSOR:
        return ModelView(model_id, name, mc.max_batch, engine.inputs, engine.outputs, mc.timeout_ms)
    if len(engine.inputs) != 1 or engine.inputs[0].dtype != np.float32:
        raise EngineError(f"models.{name}.input = {mc.input!r}: a preset feeds one float32 input; the engine takes "
                          f"{[(s.name, s.dtype.name) for s in engine.inputs]}")
    if mc.input == P.InputKind.IMAGE:
        wire = IOSpec("image", np.dtype(np.uint8), (-1,))
    else:
        wire = IOSpec("frames", np.dtype(np.uint8), (-1, *mc.frame_shape, 3))
    photos = Photos(mc.input, mc.max_image_bytes, mc.max_image_pixels, mc.preprocess)
    return ModelView(model_id, name, mc.max_batch, [wire], engine.outputs, mc.timeout_ms, photos)


def photo_runner(view: ModelView, engine: Engine, batcher: Batcher[Work], mc: ModelSection,
                 lone: Engine | None) -> BatchRunner:
    """The runner of a model whose clients send images or frames: decoded and preprocessed on its threads, or
    on a GPU worker by the device stage into the engine's input."""
    if is_device_engine(engine):
        return device_photo_runner(view, cast("DeviceEngine", engine), batcher, mc)
    decoder = None
    counters = ModelCounters()
    if mc.input == P.InputKind.IMAGE:
        entry = imaging.decoder_for(gpu=False)
        if entry is None:
            raise EngineError(f"models.{view.name}.input = \"image\": no CPU decoder in the table")
        try:
            decoder = make_decoder(entry.load_class(), f"models.{view.name}.max_image_pixels")
        except ImportError as exc:
            raise EngineError(f"models.{view.name}.input = \"image\": decoder {entry.name!r} cannot load ({exc}); "
                              "install shmbroker[serve]") from None
        log.info("model %s decodes images on the cpu with %s (%s)", view.name, entry.name, decoder.backend)
        counters.decoder = f"{entry.name} on the worker's CPU"
    try:
        prep = Preprocessor(mc.preprocess, engine.inputs[0].shape, decoder, mc.max_image_pixels, view.name)
    except ValueError as exc:
        raise EngineError(str(exc)) from None
    return PhotoRunner(view, engine, batcher, counters, prep, mc.instances, lone)


def device_photo_runner(view: ModelView, engine: DeviceEngine, batcher: Batcher[Work],
                        mc: ModelSection) -> BatchRunner:
    """A GPU worker's runner of images or frames: the table's GPU decoder stage as the pipeline's step (3)."""
    entry = imaging.decoder_for(gpu=True)
    if entry is None:
        raise EngineError(f"models.{view.name}.input = {mc.input!r}: no GPU decoder in the table "
                          "(broker/common/imaging.py, DECODERS); serve it from worker.devices \"cpu\"")
    try:
        stage_class = entry.load_class()
        stage = stage_class(view, mc.preprocess, engine.inputs[0].shape, engine.device, mc.max_image_pixels,
                            mc.frame_shape if mc.input == P.InputKind.FRAMES else (), decoder=mc.gpu_decoder)
    except ValueError as exc:
        raise EngineError(str(exc)) from None
    return DevicePhotoRunner(view, engine, batcher, ModelCounters(), mc.streams, stage)


def make_runner(model: ModelView, engine: Engine, batcher: Batcher[Work], streams: int,
                instances: int = 1, lone: Engine | None = None) -> BatchRunner:
    """The GPU pipeline (``streams`` stream slots, sharing the device by the batcher's policy) for a device
    engine, else the host runner (``instances``, ``lone`` for a batch that runs alone)."""
    if is_device_engine(engine):
        return PipelineRunner(model, cast("DeviceEngine", engine), batcher, ModelCounters(), streams)
    return ModelRunner(model, engine, batcher, ModelCounters(), instances, lone)


def lone_engine(cfg: Config, name: str) -> Engine | None:
    """For a CPU model of several instances with a fixed thread count: the model on all their threads, with
    ONNX Runtime's spinning on, for a batch that runs alone; None for every other model."""
    mc = cfg.models[name]
    if mc.engine != "onnxruntime" or mc.instances < 2 or mc.intra_op_threads < 1:
        return None
    from shmbroker.gpu_worker.engines.onnxruntime import OnnxRuntimeEngine

    return OnnxRuntimeEngine(model_source.resolve(cfg.model_path(name)),
                             intra_op_threads=mc.instances * mc.intra_op_threads, spin=True)


def overloaded_message(model: str, size: int) -> str:
    return f"model {model!r} has {size} requests queued (models.{model}.max_queue_size)"


def _spec(s: IOSpec) -> P.TensorSpec:
    return P.TensorSpec(s.name, s.dtype.name, list(s.shape))


def _input_spec(s: IOSpec, v: ModelView) -> P.TensorSpec:
    if v.photos is None:
        return _spec(s)
    max_bytes = v.photos.max_bytes if v.photos.kind == P.InputKind.IMAGE else 0
    return P.TensorSpec(s.name, s.dtype.name, list(s.shape), v.photos.kind, max_bytes)


def model_info(v: ModelView) -> P.ModelInfo:
    return P.ModelInfo(v.model_id, v.name, v.max_batch, [_input_spec(s, v) for s in v.inputs],
                       [_spec(s) for s in v.outputs], v.timeout_ms)
