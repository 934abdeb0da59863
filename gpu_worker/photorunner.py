"""The host runner of a model whose clients send images or frames: each batch's rows are decoded and
preprocessed (gpu_worker/photos.py) on the runner's own thread into the engine's input, then run as any batch.

A request with a row that cannot be decoded is answered BAD_IMAGE alone, naming the row and why; the batch's
other requests run. The decode time counts in the runner's run time, so such a model never runs inline.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from shmbroker.broker.common import protocol as P
from shmbroker.gpu_worker.batcher import Batcher
from shmbroker.gpu_worker.engines.base import Engine
from shmbroker.gpu_worker.intake import ModelView, image_rows
from shmbroker.gpu_worker.photos import ImageError, Preprocessor
from shmbroker.gpu_worker.runner import ModelRunner, _Buffers
from shmbroker.gpu_worker.work import ModelCounters, Work, reply

log = logging.getLogger(__name__)


class PhotoRunner(ModelRunner):
    """(1) take a batch, (2) answer the expired, (3) decode and preprocess each request's rows into the engine's
    input (a bad row answers its request), (4) run, (5) complete."""

    inputs_run_time = True  # decoding is the costly part: a photo model never runs inline on the IO thread

    def __init__(self, model: ModelView, engine: Engine, batcher: Batcher[Work], counters: ModelCounters,
                 prep: Preprocessor, instances: int = 1, lone: Engine | None = None) -> None:
        super().__init__(model, engine, batcher, counters, instances, lone)
        self.prep = prep
        spec = engine.inputs[0]
        self._feed = spec
        self._images = model.photos is not None and model.photos.kind == P.InputKind.IMAGE
        self._batches: dict[int, np.ndarray] = {}  # per instance's buffers (by id): the engine's input batch

    def _inputs(self, works: list[Work], bufs: _Buffers) -> tuple[list[Work], dict[str, np.ndarray], int]:
        """(3) Decode and preprocess: the requests whose rows all went into the batch, the feeds, their rows."""
        ok, rows, batch = self._prepare(works, bufs)
        return ok, self.feeds(batch, rows), rows

    def feeds(self, batch: np.ndarray, rows: int) -> dict[str, np.ndarray]:
        """The engine's feeds of the first ``rows`` rows of ``batch``."""
        return {self._feed.name: batch[:rows]}

    def new_batch(self) -> np.ndarray:
        """An empty engine input of ``max_batch`` rows, for ``decode_rows``."""
        return np.empty((self.model.max_batch, *self._feed.item_shape), np.float32)

    def _batch(self, bufs: _Buffers) -> np.ndarray:
        batch = self._batches.get(id(bufs))
        if batch is None:
            batch = self._batches[id(bufs)] = self.new_batch()
        return batch

    def _prepare(self, works: list[Work], bufs: _Buffers) -> tuple[list[Work], int, np.ndarray]:
        """The requests whose every row went into the engine's batch, their rows, and the batch; the others are
        answered BAD_IMAGE here."""
        batch = self._batch(bufs)
        ok: list[Work] = []
        row = 0
        frames = None if self._images else ModelRunner._gather(self, works, bufs)[0][self.model.inputs[0].name]
        for w in works:
            if frames is not None:
                for k in range(w.rows):
                    self.prep.frame(frames[row + k], batch[row + k])
                error = None
            else:
                error = self._decode(w, batch, row)
            if error is None:
                ok.append(w)
                row += w.rows
            else:
                self.counters.count(P.Status.BAD_IMAGE)
                reply([w], P.Status.BAD_IMAGE, f"{self.model.inputs[0].name} {error}")
        return ok, row, batch

    def _decode(self, w: Work, batch: np.ndarray, row: int) -> str | None:
        """Decode ``w``'s rows into ``batch`` from ``row`` on; None, or the first bad row and why."""
        images = image_rows(w.session, w.req)
        return images if isinstance(images, str) else self.decode_rows(images, batch, row)

    def decode_rows(self, images: Sequence[memoryview], batch: np.ndarray, row: int) -> str | None:
        """Decode and preprocess ``images`` into ``batch`` from ``row`` on (the worker's path from a request's
        rows to the engine's input; bench/photo_inprocess.py times it); None, or the first bad row and why."""
        for k, data in enumerate(images):
            try:
                self.prep.image(data, batch[row + k])
            except ImageError as exc:
                return f"row {k}: {exc}"
            except Exception as exc:  # noqa: BLE001 - a decoder's own failure on one image answers that request only
                log.warning("model %s: row %d of a request failed to decode: %r", self.model.name, k, exc)
                return f"row {k}: cannot decode: {type(exc).__name__}: {exc}"
        return None
