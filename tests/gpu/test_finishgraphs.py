"""gpu_worker/finishgraphs.py on a CUDA device: the captured ``finish``, compiled by TorchInductor, gives the
eager recipe's rows (opennsfw's exactly; imagenet's within a float32 unit of the last place, FusedFinish), for a
batch of any size up to the slot's rows, whatever an earlier, larger batch left in the buffers. Skipped without
a CUDA device or torch (CI)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from shmbroker.gpu_worker import cuda
from shmbroker.gpu_worker.devicerecipe import DeviceRecipe
from shmbroker.gpu_worker.finishgraphs import FinishGraphs, FusedFinish

pytestmark = pytest.mark.skipif(not cuda.available(), reason="needs a CUDA device and cuda-python")
torch: Any = pytest.importorskip("torch")

ROWS = 12


@pytest.mark.parametrize("preset,nchw", [("opennsfw", False), ("imagenet", True)])
def test_the_graphs_give_the_recipes_rows(preset: str, nchw: bool) -> None:
    dev = torch.device("cuda", 0)
    recipe = DeviceRecipe(preset, nchw, torch, lambda a: torch.as_tensor(a, device=dev))
    shape = (ROWS, 3, 224, 224) if nchw else (ROWS, 224, 224, 3)
    out = torch.full(shape, float("nan"), dtype=torch.float32, device=dev)
    stream = torch.cuda.Stream(dev)
    gen = torch.Generator(device=dev).manual_seed(7)
    fused = FusedFinish(torch, recipe)
    with torch.cuda.device(dev), torch.cuda.stream(stream):
        graphs = FinishGraphs(torch, recipe, out, ROWS, dev, fused)
        assert fused.compiled  # the graphs replay the compiled recipe, not the eager fallback
        for n in (ROWS, 5, 1, 8):  # a full batch first, so the smaller ones run over its rows
            x = torch.randint(0, 256, (n, 3, 224, 224), generator=gen, device=dev).to(torch.float64)
            graphs.crops[:n] = x
            graphs.run(n)
            want = recipe.finish(x).to(torch.float32)
            stream.synchronize()
            got = out[:n]
            if preset == "opennsfw":
                assert torch.equal(got, want), (n, float((got - want).abs().max()))
            else:
                torch.testing.assert_close(got, want, rtol=2**-23, atol=0)
            assert np.isfinite(out.cpu().numpy()).all()


def test_more_rows_than_the_graphs_hold_are_refused() -> None:
    dev = torch.device("cuda", 0)
    recipe = DeviceRecipe("imagenet", True, torch, lambda a: torch.as_tensor(a, device=dev))
    out = torch.zeros((4, 3, 224, 224), dtype=torch.float32, device=dev)
    with torch.cuda.device(dev), torch.cuda.stream(torch.cuda.Stream(dev)):
        graphs = FinishGraphs(torch, recipe, out, 4, dev, lambda crops: recipe.finish(crops).to(torch.float32))
        with pytest.raises(ValueError, match="5 rows"):
            graphs.run(5)


def test_the_compiled_finish_gives_the_eager_rows_of_real_crops() -> None:
    """Crops of a smooth gradient with noise, as photographs give, through both: equal bit for bit."""
    dev = torch.device("cuda", 0)
    recipe = DeviceRecipe("opennsfw", False, torch, lambda a: torch.as_tensor(a, device=dev))
    fused = FusedFinish(torch, recipe)
    gen = torch.Generator(device=dev).manual_seed(3)
    ramp = torch.linspace(0, 255, 224, device=dev, dtype=torch.float64)
    for n in (3, 64):
        noise = torch.randint(-20, 21, (n, 3, 224, 224), generator=gen, device=dev).to(torch.float64)
        x = (ramp[None, None, :, None] * 0.5 + ramp[None, None, None, :] * 0.5 + noise).round().clamp(0, 255)
        got, want = fused(x), recipe.finish(x).to(torch.float32)
        assert fused.compiled
        assert torch.equal(got, want), (n, float((got - want).abs().max()))
