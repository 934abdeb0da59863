"""The parts of a GPU worker's photo stage (gpu_worker/devicephotos.py) that run without a GPU: grouping, the
engine layout check, the device-buffer wrapper, the decoder tables and the refusals where torch or every GPU
decoder is missing.
tests/gpu/test_device_photos.py runs the stage itself on a GPU."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from shmbroker.broker.common import imaging
from shmbroker.broker.common import protocol as P
from shmbroker.broker.common.config import ModelSection
from shmbroker.gpu_worker.batcher import Batcher
from shmbroker.gpu_worker.batching import BatchPolicy
from shmbroker.gpu_worker.devicedecoders import DECODERS, DeviceDecoder, NoDecoder, open_decoder
from shmbroker.gpu_worker.devicephotos import CudaArray, chunks, engine_layout, group_by_size
from shmbroker.gpu_worker.engines.base import EngineError, IOSpec
from shmbroker.gpu_worker.intake import ModelView, Photos
from shmbroker.gpu_worker.models import device_photo_runner


def test_images_group_by_size_in_first_seen_order() -> None:
    shapes = [(480, 640), (1024, 768), (480, 640), (50, 50), (1024, 768), (480, 640)]
    assert group_by_size(shapes) == {(480, 640): [0, 2, 5], (1024, 768): [1, 4], (50, 50): [3]}
    assert group_by_size([]) == {}


def test_a_group_splits_into_chunks_within_the_pixel_budget() -> None:
    assert chunks(list(range(10)), 100, budget=300) == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    assert chunks([4, 7], 10_000, budget=300) == [[4], [7]]  # one image over the budget still goes, alone
    assert chunks([1, 2, 3], 100, budget=10_000) == [[1, 2, 3]]


def test_the_engine_layout_follows_its_input_shape() -> None:
    assert engine_layout("opennsfw", (-1, 224, 224, 3), "nsfw") is False
    assert engine_layout("imagenet", (-1, 3, 224, 224), "resnet") is True
    with pytest.raises(ValueError, match=r"models.resnet.preprocess: preset 'imagenet' makes .* \[-1, 3, 299, 299\]"):
        engine_layout("imagenet", (-1, 3, 299, 299), "resnet")


def test_the_engine_buffer_is_described_for_a_zero_copy_wrap() -> None:
    face = CudaArray(0x7F00_0000_0000, (256, 224, 224, 3)).__cuda_array_interface__
    assert face == {"shape": (256, 224, 224, 3), "typestr": "<f4", "data": (0x7F00_0000_0000, False),
                    "strides": None, "version": 3, "stream": None}


def test_the_decoder_table_has_a_row_for_each_kind_of_worker() -> None:
    cpu, gpu = imaging.decoder_for(gpu=False), imaging.decoder_for(gpu=True)
    assert cpu is not None and cpu.name == "libjpeg-turbo"
    assert gpu is not None and gpu.name == "nvjpeg" and gpu.gpu
    assert gpu.load_class().__name__ == "DevicePhotos"  # imports without torch: torch loads when a stage is built


class _DeviceEngine:
    """What device_photo_runner reads of a GPU engine (no context is made before the stage)."""

    device = 0
    inputs = [IOSpec("data", np.dtype(np.float32), (-1, 224, 224, 3))]
    outputs = [IOSpec("prob", np.dtype(np.float32), (-1, 2))]

    def create_context(self, *args: object) -> None:
        raise AssertionError("no stream slot is made before the stage loads")


def _load_photo_model(**keys: object) -> None:
    """The GPU worker's builder on a model of photos (``keys`` of its section); what it raises goes out."""
    mc = ModelSection(path="m.onnx", input="image", preprocess="opennsfw", **keys)  # type: ignore[arg-type]
    view = ModelView(0, "nsfw_photo", 8, [IOSpec("image", np.dtype(np.uint8), (-1,))], _DeviceEngine.outputs, 1000,
                     Photos(P.InputKind.IMAGE, mc.max_image_bytes, mc.max_image_pixels, "opennsfw"))
    device_photo_runner(view, _DeviceEngine(), Batcher(BatchPolicy.from_config(mc, device=True)),  # type: ignore[arg-type]
                        mc)


@pytest.mark.skipif(importlib.util.find_spec("torch") is not None, reason="torch is installed here")
def test_a_gpu_worker_without_torch_refuses_a_photo_model_naming_the_key() -> None:
    with pytest.raises(EngineError, match=r"models\.nsfw_photo\.input on a GPU worker decodes on CUDA with torch: "
                                          r".*install torch"):
        _load_photo_model()


def test_an_unknown_gpu_decoder_is_refused_naming_the_key_and_the_choices() -> None:
    with pytest.raises(EngineError, match=r"models\.nsfw_photo\.gpu_decoder = 'nvdec': one of nvimgcodec, "
                                          r"nvimgcodec-cuda, torchvision, or \"\" for the first that works"):
        _load_photo_model(gpu_decoder="nvdec")


def test_with_no_decoder_that_opens_the_error_gives_each_ones_reason() -> None:
    """Each decoder of the table is tried in order; where none opens (here: no CUDA build of torch, nor
    nvImageCodec), the error names every one, why, and what to install."""
    assert list(DECODERS) == ["nvimgcodec", "nvimgcodec-cuda", "torchvision"]  # libjpeg's chroma upsampling first

    class NoCuda:
        class cuda:  # torch's attribute
            @staticmethod
            def get_device_name(device: int) -> str:
                raise RuntimeError("Found no NVIDIA driver on your system")

    with pytest.raises(NoDecoder) as err:
        open_decoder(NoCuda(), 0)
    assert list(err.value.reasons) == ["nvimgcodec", "nvimgcodec-cuda", "torchvision"]
    assert all(err.value.reasons.values())
    assert "pip install nvidia-nvimgcodec-cu13" in str(err.value)


def test_a_decoder_library_of_another_api_is_passed_over_with_its_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    """A decoder whose library takes other arguments (another nvImageCodec's constructor) is a reason, and the
    next decoder is tried, not an error out of the worker."""
    def other_api(torch: object, device: int, max_batch: int) -> DeviceDecoder:
        raise TypeError("__init__(): incompatible constructor arguments")

    def no_attribute(torch: object, device: int, max_batch: int) -> DeviceDecoder:
        raise AttributeError("module 'nvidia.nvimgcodec' has no attribute 'Backend'")

    monkeypatch.setitem(DECODERS, "other", other_api)
    monkeypatch.setitem(DECODERS, "older", no_attribute)
    with pytest.raises(NoDecoder) as err:
        open_decoder(object(), 0, ("other", "older"))
    assert err.value.reasons == {"other": "TypeError: __init__(): incompatible constructor arguments",
                                 "older": "AttributeError: module 'nvidia.nvimgcodec' has no attribute 'Backend'"}


def test_model_stats_name_the_decoder_and_read_old_replies() -> None:
    import msgspec

    stats = P.ModelStats("m", {}, 0, {}, 0, decoder="nvjpeg on cuda:0")
    assert msgspec.json.decode(msgspec.json.encode(stats), type=P.ModelStats).decoder == "nvjpeg on cuda:0"
    old = b'{"name":"m","requests":{},"batches":0,"batch_items":{},"queue_depth":0}'
    assert msgspec.json.decode(old, type=P.ModelStats).decoder == ""
