"""Photos on a GPU worker: each batch's images decoded and preprocessed on the device, on the batch's stream,
straight into the engine's input buffer (``DevicePhotos``), run by ``DevicePhotoRunner``.

Per batch, (3a) on the CPU, without decoding: each row's bytes are read in place from its ring slot and its header
checked (gpu_worker/imageheader.py: format, size against ``max_image_pixels``, an end marker); a request with a bad
row is answered BAD_IMAGE naming the row and why, and the batch goes on without it. (3b) The JPEG rows are decoded
in one batched call of the first decoder of gpu_worker/devicedecoders.py that works on the device (nvImageCodec's
nvJPEG with libjpeg's chroma upsampling, else torchvision's decode_jpeg), on the batch's stream; a row that does
not decode is answered alone. The decoded images are kept until the slot's next batch. PNG rows, CMYK and other
JPEGs nvJPEG does not take decode on the worker's CPU with Pillow, as a CPU worker's do, and are uploaded. (3c) The
images are grouped by size and each group is resized and cropped (gpu_worker/devicerecipe.py: Pillow's resize,
computed for the crop's pixels only), then the batch's crops go through the rest of the preset together (the
opennsfw JPEG round trip, channel order, normalisation, layout) on the batch's stream into the engine's input
buffer, which is wrapped as a torch tensor without a copy: a batch of photos of as many sizes costs eight
launches a photo and one preset's worth for the batch. Frames (``input = "frames"``) are copied in and take (3c)
alone.

torch and the decoders are imported when a stage is built, never by the modules that import this one.
"""

from __future__ import annotations

import io
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shmbroker.broker.common import protocol as P
from shmbroker.gpu_worker.batcher import Batcher
from shmbroker.gpu_worker.devicedecoders import DECODERS, DeviceDecoder, NoDecoder, open_decoder
from shmbroker.gpu_worker.devicerecipe import DeviceRecipe
from shmbroker.gpu_worker.engines.base import DeviceEngine, EngineError
from shmbroker.gpu_worker.finishgraphs import FinishGraphs, FusedFinish
from shmbroker.gpu_worker.imageheader import JPEG, Header, read_header
from shmbroker.gpu_worker.intake import ModelView, image_rows
from shmbroker.gpu_worker.photos import PRESETS, ImageError, pillow_decode
from shmbroker.gpu_worker.pipeline import PipelineRunner
from shmbroker.gpu_worker.runner import Progress, quiet
from shmbroker.gpu_worker.streams import StreamSlot
from shmbroker.gpu_worker.work import ModelCounters, Work, reply

log = logging.getLogger(__name__)

# a group of same-size images goes through the recipe in chunks of at most this many pixels: its float64
# copy (8 bytes a channel) stays under about 400 MB whatever the batch
CHUNK_PIXELS = 1 << 24


def group_by_size(shapes: Sequence[tuple[int, int]]) -> dict[tuple[int, int], list[int]]:
    """The indices of ``shapes`` by (height, width), in first-seen order: one batched resize per group."""
    groups: dict[tuple[int, int], list[int]] = {}
    for i, shape in enumerate(shapes):
        groups.setdefault(shape, []).append(i)
    return groups


def chunks(indices: list[int], pixels: int, budget: int = CHUNK_PIXELS) -> list[list[int]]:
    """``indices`` (of images of ``pixels`` pixels each) split so that each chunk holds at most ``budget``
    pixels, and at least one image."""
    per = max(1, budget // max(1, pixels))
    return [indices[i : i + per] for i in range(0, len(indices), per)]


def engine_layout(preset: str, engine_shape: Sequence[int], model: str) -> bool:
    """Whether the engine's input is NCHW (else NHWC) for the preset's rows; ValueError names the key."""
    size = PRESETS[preset].size
    if tuple(engine_shape[1:]) == (size, size, 3):
        return False
    if tuple(engine_shape[1:]) == (3, size, size):
        return True
    raise ValueError(f"models.{model}.preprocess: preset {preset!r} makes [N, {size}, {size}, 3] (or "
                     f"[N, 3, {size}, {size}]) float32; the engine's input is {list(engine_shape)}")


@dataclass
class Batch:
    """One batch through (3a)-(3b): the requests that still run, each with its decoded images, and those
    answered BAD_IMAGE with their reasons."""

    ok: list[Work] = field(default_factory=list)
    images: list[list[Any]] = field(default_factory=list)  # per ok request: its rows, [3, H, W] uint8 on device
    bad: list[tuple[Work, str]] = field(default_factory=list)

    @property
    def rows(self) -> int:
        return sum(len(i) for i in self.images)


class CudaArray:
    """A device buffer as ``__cuda_array_interface__`` (version 3): torch wraps it without a copy. No stream is
    named: the buffer is the engine's, ordered by the batch's stream."""

    def __init__(self, ptr: int, shape: tuple[int, ...], typestr: str = "<f4") -> None:
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr, "data": (ptr, False),
                                         "strides": None, "version": 3, "stream": None}


class DevicePhotos:
    """One model's stage (3) on one GPU: ``run(works, slot)`` reads, checks, decodes and preprocesses a batch
    into the slot's engine input buffer, on the slot's stream, and says which requests run and which are bad."""

    def __init__(self, model: ModelView, preset: str, engine_shape: Sequence[int], device: int,
                 max_pixels: int, frame_shape: Sequence[int] = (), decoder: str = "") -> None:
        """``decoder``: a name of devicedecoders.DECODERS, or "" for the first that works
        (``models.NAME.gpu_decoder``); EngineError names the key that needs changing."""
        if decoder and decoder not in DECODERS:
            raise EngineError(f"models.{model.name}.gpu_decoder = {decoder!r}: one of {', '.join(DECODERS)}, or \"\" "
                              "for the first that works on the device")
        try:
            import torch
        except ImportError as exc:
            raise EngineError(f"models.{model.name}.input on a GPU worker decodes on CUDA with torch: {exc}; "
                              "install torch (a CUDA build)") from None
        self.torch = torch
        try:
            self.decoder = open_decoder(torch, device, (decoder,) if decoder else tuple(DECODERS), model.max_batch)
        except NoDecoder as exc:
            key = f"gpu_decoder = {decoder!r}" if decoder else "input = \"image\""
            raise EngineError(f"models.{model.name}.{key} on a GPU worker: {exc}") from None
        self.model = model
        self.name = model.inputs[0].name
        self.device = torch.device("cuda", device)
        self.max_pixels = max_pixels
        self.setting = f"models.{model.name}.max_image_pixels"
        self.frame_shape = tuple(frame_shape)
        self.item_shape = tuple(int(d) for d in engine_shape[1:])
        self.nchw = engine_layout(preset, engine_shape, model.name)
        self.recipe = DeviceRecipe(preset, self.nchw, torch, lambda a: torch.as_tensor(a, device=self.device))
        self._finish_rows = max(1, CHUNK_PIXELS // (self.recipe.size * self.recipe.size))
        self._finish = FusedFinish(torch, self.recipe)  # compiled at the first slot's warm-up, shared
        self.backend = f"{self.decoder.backend}; PNG and CMYK on the worker's CPU (Pillow)"
        self._streams: dict[int, Any] = {}
        self._outs: dict[int, Any] = {}
        self._frames: dict[int, Any] = {}
        # each slot's last decoded images, kept until its next batch: the decoder's buffers outlive their reads
        # on the slot's stream, whoever allocated them
        self._held: dict[int, list[list[Any]]] = {}
        self._graphs: dict[int, FinishGraphs] = {}  # per slot, from its warm-up
        # one decoder per slot: a decoder waits at each call for its previous batch to leave the device, so a
        # shared one would hold one slot's decode until the other's ended
        # (bench/RESULTS.md#photos-on-the-hardware-decoder-alone-with-full-batches)
        self._decoders: dict[int, DeviceDecoder] = {}

    # -- per stream slot, made once ----------------------------------------------------------------------
    def _stream(self, slot: StreamSlot) -> Any:
        s = self._streams.get(slot.index)
        if s is None:
            s = self._streams[slot.index] = self.torch.cuda.ExternalStream(slot.stream.handle, device=self.device)
        return s

    def _decoder(self, slot: StreamSlot) -> DeviceDecoder:
        """The slot's own decoder, of the kind ``open_decoder`` chose; the first slot's is that one."""
        d = self._decoders.get(slot.index)
        if d is None:
            d = self.decoder.twin() if self._decoders else self.decoder
            self._decoders[slot.index] = d
        return d

    def _out(self, slot: StreamSlot) -> Any:
        """The slot's engine input buffer as a float32 tensor [max_batch, *item_shape], no copy."""
        t = self._outs.get(slot.index)
        if t is None:
            shape = (self.model.max_batch, *self.item_shape)
            t = self._outs[slot.index] = self.torch.as_tensor(CudaArray(slot.ctx.input_ptrs[0], shape),
                                                               device=self.device)
        return t

    def close(self) -> None:
        """Drop the slots' held images and views once their streams are done; call before the slots close:
        the decoder frees an image on the stream that allocated it, which must still exist then."""
        for stream in self._streams.values():
            stream.synchronize()
        self._held.clear()
        self._graphs.clear()
        self._outs.clear()
        self._frames.clear()
        self._streams.clear()

    # -- one batch ---------------------------------------------------------------------------------------
    def run(self, works: list[Work], slot: StreamSlot) -> Batch:
        """(3) The batch's requests into the slot's engine input, queued on its stream; raises only for a fault
        of the device or the stage (the caller fails the batch), never for a bad image."""
        torch = self.torch
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream(slot)):
            batch = self._frames_in(works, slot) if self.frame_shape else self._decode(works, slot)
            self._preprocess(batch, slot)
        self._held[slot.index] = batch.images
        return batch

    def run_rows(self, rows: list[memoryview], slot: StreamSlot) -> tuple[int, dict[int, str]]:
        """(3) for encoded images that are not in a ring (the in-process limit, tests), each its own request:
        how many went into the slot's engine input (in order), and the others' reasons by index."""
        checked: list[list[tuple[memoryview, Header]]] = []
        index: list[int] = []
        bad: dict[int, str] = {}
        for i, data in enumerate(rows):
            try:
                checked.append([(data, read_header(data, self.max_pixels, self.setting))])
                index.append(i)
            except ImageError as exc:
                bad[i] = f"row 0: {exc}"
        torch = self.torch
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream(slot)):
            images, failed = self._decode_all(checked, slot)
            batch = Batch(images=[im for j, im in enumerate(images) if j not in failed])
            self._preprocess(batch, slot)
        self._held[slot.index] = batch.images
        bad.update({index[j]: why for j, why in failed.items()})
        return batch.rows, bad

    def _decode(self, works: list[Work], slot: StreamSlot) -> Batch:
        """(3a) headers, (3b) decodes: the requests whose every row decoded, with their images."""
        batch = Batch()
        rows: list[list[tuple[memoryview, Header]]] = []
        checked: list[Work] = []
        for w in works:
            read = self._read(w)
            if isinstance(read, str):
                batch.bad.append((w, read))
            else:
                checked.append(w)
                rows.append(read)
        images, failed = self._decode_all(rows, slot)
        for i, w in enumerate(checked):
            if i in failed:
                batch.bad.append((w, failed[i]))
            else:
                batch.ok.append(w)
                batch.images.append(images[i])
        return batch

    def _decode_all(self, rows: list[list[tuple[memoryview, Header]]],
                    slot: StreamSlot) -> tuple[list[list[Any]], dict[int, str]]:
        """Each request's checked rows decoded: the JPEGs nvJPEG takes in one call on the device, the others on
        the CPU; the images per request, and the first bad row of each failed request by its index."""
        gpu = [(i, k) for i, r in enumerate(rows) for k, (_, h) in enumerate(r) if h.gpu]
        images: list[list[Any]] = [[None] * len(r) for r in rows]
        failed: dict[int, str] = {}
        decoded = self._decoder(slot).decode([rows[i][k][0] for i, k in gpu], self._stream(slot)) if gpu else []
        for (i, k), image in zip(gpu, decoded, strict=True):
            if isinstance(image, str):
                failed.setdefault(i, f"row {k}: {image}")
            else:
                images[i][k] = image
        for i, r in enumerate(rows):
            for k, (data, head) in enumerate(r):
                if head.gpu or i in failed:
                    continue
                try:
                    arr = pillow_decode(data, "JPEG" if head.kind == JPEG else "PNG", self.max_pixels, self.setting)
                except ImageError as exc:
                    failed[i] = f"row {k}: {exc}"
                    continue
                images[i][k] = self._upload(self.torch.from_numpy(arr)).permute(2, 0, 1)
        return images, failed

    def _upload(self, t: Any) -> Any:
        """A host tensor to the device on the current stream, without holding the host for it (through
        torch's page-locked staging, which keeps the block until the copy ends)."""
        return t.pin_memory().to(self.device, non_blocking=True)

    def _read(self, w: Work) -> list[tuple[memoryview, Header]] | str:
        """Each row's bytes (in place, in the ring) and header, or the first bad row and why."""
        images = image_rows(w.session, w.req)
        if isinstance(images, str):
            return images
        out = []
        for k, data in enumerate(images):
            try:
                out.append((data, read_header(data, self.max_pixels, self.setting)))
            except ImageError as exc:
                return f"row {k}: {exc}"
        return out

    def _frames_in(self, works: list[Work], slot: StreamSlot) -> Batch:
        """Frames: each request's rows copied from its ring slot into the slot's uint8 staging buffer."""
        torch = self.torch
        staging = self._frames.get(slot.index)
        if staging is None:
            staging = self._frames[slot.index] = torch.empty((self.model.max_batch, *self.frame_shape, 3),
                                                             dtype=torch.uint8, device=self.device)
        batch = Batch()
        row = 0
        for w in works:
            t = w.req.tensors[0]
            w.session.ensure_registered()  # page-locked: the copy runs on the stream without holding the host
            start = w.session.layout.input_bases[w.req.slot] + t.offset
            src = torch.frombuffer(w.session.segment.buf[start : start + t.nbytes], dtype=torch.uint8)
            rows = staging[row : row + w.rows]
            rows.copy_(src.view(rows.shape), non_blocking=True)
            batch.ok.append(w)
            batch.images.append(list(rows.permute(0, 3, 1, 2)))
            row += w.rows
        return batch

    def _preprocess(self, batch: Batch, slot: StreamSlot) -> None:
        """(3c) Each size group, in chunks, resized and cropped (``DeviceRecipe.crop``), then the batch's crops
        through the rest of the preset at once (``finish``: the slot's CUDA graphs once warmed up) into the
        first rows of the slot's engine input."""
        torch = self.torch
        images = [img for per in batch.images for img in per]
        if not images:
            return
        graphs = self._graphs.get(slot.index)
        if graphs is not None and len(images) <= graphs.rows:
            crops = graphs.crops[: len(images)]
        else:
            graphs = None
            crops = torch.empty((len(images), 3, self.recipe.size, self.recipe.size), dtype=torch.float64,
                                device=self.device)
        for (h, w), members in group_by_size([(int(i.shape[1]), int(i.shape[2])) for i in images]).items():
            for chunk in chunks(members, h * w):
                x = images[chunk[0]][None] if len(chunk) == 1 else torch.stack([images[i] for i in chunk])
                rows = self.recipe.crop(x.to(torch.float64))
                if chunk == list(range(chunk[0], chunk[0] + len(chunk))):
                    crops[chunk[0] : chunk[0] + len(chunk)] = rows
                else:
                    crops.index_copy_(0, self._upload(torch.tensor(chunk)), rows)
        if graphs is not None:
            graphs.run(len(images))
            return
        out = self._out(slot)
        for start in range(0, len(images), self._finish_rows):
            end = min(len(images), start + self._finish_rows)
            out[start:end] = self._finish(crops[start:end])

    def warm_up_step(self, slot: StreamSlot, slots: int) -> str:
        """What ``warm_up(slot)`` is about to do, as a starting worker reports it."""
        step = f"warming its photo stage on stream slot {slot.index + 1} of {slots} (CUDA graphs of its finish step)"
        if self._finish.compiles_next:
            step += "; TorchInductor compiles the finish step first, a minute or more where its cache is cold"
        return step

    def warm_up(self, slot: StreamSlot) -> float:
        """Decode and preprocess one small image on the slot's stream (the first call of each sets up its
        library state); the seconds it took."""
        from PIL import Image

        torch = self.torch
        t0 = time.perf_counter()
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream(slot)):
            if self.frame_shape:
                images = [torch.zeros((3, *self.frame_shape), dtype=torch.uint8, device=self.device)]
            else:
                with io.BytesIO() as buf:
                    Image.new("RGB", (320, 240), (90, 140, 200)).save(buf, format="JPEG")
                    images = self._decoder(slot).decode([memoryview(bytearray(buf.getvalue()))], self._stream(slot))
            self._preprocess(Batch(images=[images]), slot)
            slot.stream.synchronize()
            took = time.perf_counter() - t0
            self._graphs[slot.index] = FinishGraphs(torch, self.recipe, self._out(slot),
                                                    min(self.model.max_batch, self._finish_rows), self.device,
                                                    self._finish)
        slot.stream.synchronize()
        return took


class DevicePhotoRunner(PipelineRunner):
    """A device engine whose clients send images or frames: step (3) is the photo stage (``DevicePhotos``)
    instead of copies, and a request with a bad row is answered BAD_IMAGE before the batch computes. The stage
    decodes on the host's time (the decoder holds the host for its decode), so batches never launch on the
    intake thread and never fill early; the ``h2d`` stage times decode and preprocessing on the device."""

    watches_ends = False

    def __init__(self, model: ModelView, engine: DeviceEngine, batcher: Batcher[Work], counters: ModelCounters,
                 streams: int, stage: DevicePhotos) -> None:
        super().__init__(model, engine, batcher, counters, streams)
        self.early = False
        if self.plan is not None:
            self.plan.lead_rows = 0  # a batch's rows reach the device together, through the stage
        self.stage = stage
        counters.decoder = stage.backend
        log.info("model %s: images decode with %s", model.name, stage.backend)

    @property
    def cheap(self) -> bool:
        return False

    def try_inline(self, watch: bool = False) -> bool:
        self.batcher.kick()
        return False

    def warm_up(self, progress: Progress = quiet) -> None:
        """As the pipeline's (each slot's context at 1 and ``max_batch`` rows, then timed), but with no copy
        probe (rows reach the engine through the stage) and the stage warmed on each slot; the launch plan's
        lead starts at the stage's time for one small image and learns from the batches."""
        first = self._warm_contexts(progress)
        took = []
        for slot in self.slots:
            progress(self.stage.warm_up_step(slot, len(self.slots)))
            took.append(self.stage.warm_up(slot))
        if self.plan is not None:
            self.plan.prime(min(took))
        self._tell_batcher(list(getattr(first.ctx, "sizes", None) or ()))
        log.info("model %s: %d stream slots warm; one row computes in %.3f ms, a batch of %d rows in %.3f ms; "
                 "one image through the photo stage in %.1f ms", self.model.name, len(self.slots), self.one_row_ms,
                 self.model.max_batch, self.max_batch_ms, min(took) * 1e3)

    def _close_slots(self) -> None:
        self.stage.close()
        super()._close_slots()

    def _inputs_in(self, slot: StreamSlot, works: list[Work]) -> tuple[list[Work], int]:
        """(3) The stage decodes and preprocesses the batch into the engine's input; its bad rows' requests are
        answered here."""
        batch = self.stage.run(works, slot)
        self._answer_bad(batch.bad)
        return batch.ok, batch.rows

    def _answer_bad(self, bad: list[tuple[Work, str]]) -> None:
        for w, why in bad:
            self.counters.count(P.Status.BAD_IMAGE)
            reply([w], P.Status.BAD_IMAGE, f"{self.model.inputs[0].name} {why}")


def stage_limit(stage: DevicePhotos, slot: StreamSlot, rows: list[memoryview], repeats: int = 5) -> dict[str, float]:
    """The in-process limit of decode + preprocess, and of decode + preprocess + engine, for one batch of
    encoded images on one stream slot (for bench/): the best of ``repeats`` host-timed runs, each waited for on
    the device; the seconds, the images/s, and how many rows went in."""
    best_stage = best_all = math.inf
    n = 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        n, _bad = stage.run_rows(rows, slot)
        slot.stream.synchronize()
        t1 = time.perf_counter()
        slot.ctx.enqueue(n)
        slot.stream.synchronize()
        t2 = time.perf_counter()
        best_stage, best_all = min(best_stage, t1 - t0), min(best_all, t2 - t0)
    return {"rows": n, "stage_s": best_stage, "stage_images_per_s": n / best_stage,
            "with_engine_s": best_all, "with_engine_images_per_s": n / best_all}


def rows_as_array(stage: DevicePhotos, slot: StreamSlot, rows: int) -> np.ndarray:
    """The first ``rows`` rows of the slot's engine input, copied to the host (tests)."""
    slot.stream.synchronize()
    out: np.ndarray = stage._out(slot)[:rows].cpu().numpy()
    return out
