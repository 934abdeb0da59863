"""An async FastAPI server with a queue that batches: the classic "async + batching" service.

One uvicorn process (uvloop, httptools). ``POST /infer`` takes one row's raw bytes and answers the output row's
raw bytes. Each request puts its row and a Future on an asyncio queue; a batcher task takes an idle engine
instance, then the first queued row, then whatever else arrives until the batch holds ``max_batch`` rows or
``max_queue_delay_us`` has passed since its first row, and runs it on the instance in a thread of its own, so the
event loop keeps accepting while batches run. ``max_batch`` and the delay are the broker's for the same model.

No ``from __future__ import annotations`` here: FastAPI reads the endpoints' annotations as objects (``Request``
is imported where the app is built, not at module level, so a string would not resolve).
"""

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from shmbroker.bench.peers import engine as E

log = logging.getLogger(__name__)

Item = tuple[np.ndarray, "asyncio.Future[np.ndarray]"]


class Batcher:
    """Batches queued rows onto ``runners``; one batch per runner at a time, each in its own thread."""

    def __init__(self, runners: list[E.Runner], max_batch: int, delay_s: float) -> None:
        self.max_batch, self.delay_s = max_batch, delay_s
        self.runners = runners
        self.pool = ThreadPoolExecutor(len(runners), thread_name_prefix="batch")
        self.queue: asyncio.Queue[Item] = asyncio.Queue()
        self.idle: asyncio.Queue[E.Runner] = asyncio.Queue()
        self.batches = 0
        self.rows = 0

    async def infer(self, x: np.ndarray) -> np.ndarray:
        future: asyncio.Future[np.ndarray] = asyncio.get_running_loop().create_future()
        self.queue.put_nowait((x, future))
        return await future

    async def loop(self) -> None:
        for r in self.runners:
            self.idle.put_nowait(r)
        tasks: set[asyncio.Task[None]] = set()
        while True:
            runner = await self.idle.get()
            batch = [await self.queue.get()]
            deadline = asyncio.get_running_loop().time() + self.delay_s
            while len(batch) < self.max_batch:
                if self.queue.empty():
                    left = deadline - asyncio.get_running_loop().time()
                    if left <= 0:
                        break
                    try:
                        batch.append(await asyncio.wait_for(self.queue.get(), left))
                    except TimeoutError:
                        break
                else:
                    batch.append(self.queue.get_nowait())
            task = asyncio.create_task(self._run(runner, batch))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    async def _run(self, runner: E.Runner, batch: list[Item]) -> None:
        try:
            x = np.stack([row for row, _ in batch])
            out = await asyncio.get_running_loop().run_in_executor(self.pool, runner.run, x)
        except Exception as exc:  # noqa: BLE001 - the batch's requests get the error; the server goes on
            for _, f in batch:
                if not f.done():
                    f.set_exception(exc)
        else:
            self.batches += 1
            self.rows += len(batch)
            for k, (_, f) in enumerate(batch):
                if not f.done():
                    f.set_result(out[k])
        finally:
            self.idle.put_nowait(runner)


def build_app(batcher: Batcher, mi: E.ModelInfo) -> Any:
    """The FastAPI application: ``POST /infer`` (raw row in, raw row out), ``GET /health``, ``GET /stats``."""
    from fastapi import FastAPI, Request, Response

    row_bytes = int(np.prod(mi.input_shape)) * np.dtype(mi.input_dtype).itemsize

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        task = asyncio.create_task(batcher.loop())
        yield
        task.cancel()

    app = FastAPI(lifespan=lifespan, openapi_url=None, docs_url=None, redoc_url=None)

    @app.post("/infer")  # type: ignore[untyped-decorator]
    async def infer(request: Request) -> Response:
        body = await request.body()
        if len(body) != row_bytes:
            return Response(f"the body must be one row of {mi.input_shape} {mi.input_dtype}: {row_bytes} bytes, "
                            f"got {len(body)}", status_code=400)
        y = await batcher.infer(np.frombuffer(body, dtype=mi.input_dtype).reshape(mi.input_shape))
        return Response(content=y.tobytes(), media_type="application/octet-stream")

    @app.get("/health")  # type: ignore[untyped-decorator]
    async def health() -> Response:
        return Response("ok")

    @app.get("/stats")  # type: ignore[untyped-decorator]
    async def stats() -> dict[str, Any]:
        return {"batches": batcher.batches, "rows": batcher.rows}

    return app


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    ap = E.server_parser("fastapi_peer")
    ap.add_argument("--instances", type=int, default=1, help="engine instances, each running one batch at a time")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="fastapi-peer %(levelname)s %(message)s")
    _engine, runners, mi = E.open_runners(args.config, args.model, args.instances)
    batcher = Batcher(runners, mi.max_batch, mi.max_queue_delay_us / 1e6)
    server = uvicorn.Server(uvicorn.Config(build_app(batcher, mi), host=args.host, port=args.port, loop="uvloop",
                                           http="httptools", log_level="warning", access_log=False))
    server.run()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
