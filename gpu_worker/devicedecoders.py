"""The GPU worker's JPEG decoders, one table (``DECODERS``, in order of preference): each turns a batch of JPEG
rows into [3, H, W] uint8 RGB tensors on the device, queued on the caller's stream, or says why a row did not
decode. ``open_decoder`` takes the first that imports and decodes a test image on this device.

- ``nvimgcodec``: nvImageCodec's nvJPEG, the card's hardware JPEG engines where it has them, then nvJPEG's CUDA
  decoder for the rows they refuse (progressive files, 4:1:1), with libjpeg's "fancy" (triangular) chroma
  upsampling, the one the CPU recipe's Pillow decodes with; EXIF orientation is not applied (the CPU recipe
  applies none). A row it cannot decode comes back alone. nvImageCodec files the CUDA decoder under the hybrid
  backend kind: nvJPEG decodes the Huffman code of a small image on the host's threads, of a large one on the
  device; the pixels are the device's either way. The two are separate nvImageCodec decoders, the CUDA one
  asked only for the hardware's refusals: given both backends, nvImageCodec 0.6 fixes the hardware's share of
  every batch at its first decode (a one-row test image) and hands the rest of each batch to the CUDA decoder,
  whose host threads then decode most photos (bench/RESULTS.md#photos-nvimagecodecs-threads-and-the-finish-step).
- ``nvimgcodec-cuda``: the same on the CUDA decoder alone (no hardware engines), for a card without them or
  where their pixels or rate differ.
- ``torchvision``: torchvision's ``decode_jpeg`` on CUDA (nvJPEG with its own chroma upsampling: a fifth of a
  real photo's pixels differ from Pillow's, bench/RESULTS.md "The GPU stage on the H100"). A batch it refuses
  is decoded again one row at a time to find the bad rows.

torch, torchvision and nvImageCodec are imported when a decoder is opened, never by the modules that import
this one.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

log = logging.getLogger(__name__)


class DeviceDecoder(Protocol):
    """A batch of JPEG rows to device images, on ``stream`` (a ``torch.cuda`` stream)."""

    backend: str

    def decode(self, rows: list[memoryview], stream: Any) -> list[Any]:
        """Each row as [3, H, W] uint8 on the device, or a ``str``: why it did not decode."""
        ...

    def twin(self) -> DeviceDecoder:
        """A new decoder of the same kind and settings (one per stream slot)."""
        ...


class NvImageCodecDecoder:
    """nvImageCodec's decoder with fancy upsampling and no EXIF rotation (see the module's docstring), on the
    hardware JPEG engines and, for what they do not take, the CUDA decoder (``hardware=False``: CUDA only)."""

    def __init__(self, torch: Any, device: int, max_batch: int, hardware: bool = True) -> None:
        """``max_batch``: the most rows a batch decodes, which the hardware decoder allocates for up front."""
        from nvidia import nvimgcodec

        self._args = (torch, device, max_batch, hardware)
        self._nv = nvimgcodec
        self._torch = torch
        self._device = torch.device("cuda", device)
        # no CPU_ONLY kind: where nvJPEG is missing, libjpeg-turbo would decode on the worker's cores without a
        # word; then this decoder fails its test image and the next one is tried. GPU_ONLY holds no JPEG decoder
        # in nvImageCodec 0.6 (bench/RESULTS.md#photos-on-the-h100-with-nvimagecodec)
        upsampling = ":fancy_upsampling=1"
        # Backend objects, which every version takes: nvImageCodec 0.9 has no backend_kinds argument
        kinds = nvimgcodec.BackendKind
        cuda = nvimgcodec.Decoder(device_id=device, backends=[nvimgcodec.Backend(kinds.HYBRID_CPU_GPU)],
                                  options=upsampling)
        self._decoder, self._fallback = cuda, None
        if hardware:
            # sized at its first decode otherwise, which is open_decoder's one-row test image
            hw_options = f"{upsampling} nvjpeg_hw_decoder:preallocate_batch_size={max_batch}"
            self._decoder = nvimgcodec.Decoder(device_id=device, backends=[nvimgcodec.Backend(kinds.HW_GPU_ONLY)],
                                               options=hw_options)
            self._fallback = cuda
        self._params = nvimgcodec.DecodeParams(apply_exif_orientation=False, color_spec=nvimgcodec.ColorSpec.RGB,
                                               allow_any_depth=False)
        if self._fallback is not None:
            # the CUDA decoder sets itself up at its first call: now, not at the first photo the hardware refuses
            stream = torch.cuda.current_stream(device)
            self._decode_with(self._fallback, [self._code(memoryview(probe_jpeg()))], stream)
            stream.synchronize()
        engines = "hardware and CUDA" if hardware else "CUDA"
        self.backend = (f"nvImageCodec {getattr(nvimgcodec, '__version__', '?')} (nvJPEG {engines}, fancy "
                        f"upsampling) on cuda:{device} ({torch.cuda.get_device_name(device)})")

    def decode(self, rows: list[memoryview], stream: Any) -> list[Any]:
        codes = [self._code(r) for r in rows]
        images = self._decode_with(self._decoder, codes, stream)
        fallback = self._fallback
        if fallback is not None:
            images = retry_refused(images, codes, lambda cs: self._decode_with(fallback, cs, stream))
        return [self._tensor(im) if im is not None else "corrupt or truncated JPEG: nvImageCodec could not decode it"
                for im in images]

    def twin(self) -> NvImageCodecDecoder:
        return NvImageCodecDecoder(*self._args)

    def _code(self, row: memoryview) -> Any:
        return self._nv.CodeStream(np.frombuffer(row, dtype=np.uint8))

    def _decode_with(self, decoder: Any, codes: list[Any], stream: Any) -> list[Any]:
        """``decoder``'s images of ``codes`` on ``stream`` (a torch stream), ``None`` where it refused one."""
        return list(decoder.decode(codes, params=self._params, cuda_stream=stream.cuda_stream))

    def _tensor(self, image: Any) -> Any:
        """An image (on the device, or on the host where a CPU codec took it) as [3, H, W], no copy on the device.
        Through the CUDA array interface: the tensor then holds the image object itself, released under the GIL."""
        return self._torch.as_tensor(image.cuda(), device=self._device).permute(2, 0, 1)


def retry_refused(images: list[Any], codes: list[Any], decode: Callable[[list[Any]], list[Any]]) -> list[Any]:
    """``images`` (``None`` where the first decoder refused its row) with those rows decoded by ``decode`` in one
    call, in order; a row that both refuse stays ``None``."""
    refused = [i for i, im in enumerate(images) if im is None]
    if not refused:
        return images
    again = decode([codes[i] for i in refused])
    out = list(images)
    for i, im in zip(refused, again, strict=True):
        out[i] = im
    return out


class TorchvisionDecoder:
    """torchvision's ``decode_jpeg`` on CUDA (see the module's docstring)."""

    def __init__(self, torch: Any, device: int, max_batch: int) -> None:
        import torchvision
        from torchvision.io import ImageReadMode, decode_jpeg

        self._args = (torch, device, max_batch)
        self._torch = torch
        self._decode_jpeg = decode_jpeg
        self._rgb = ImageReadMode.RGB
        self._device = torch.device("cuda", device)
        self.backend = (f"nvJPEG through torchvision {torchvision.__version__} decode_jpeg on cuda:{device} "
                        f"({torch.cuda.get_device_name(device)})")

    def decode(self, rows: list[memoryview], stream: Any) -> list[Any]:
        tensors = [self._torch.frombuffer(r, dtype=self._torch.uint8) for r in rows]
        try:
            return list(self._decode_jpeg(tensors, mode=self._rgb, device=self._device))
        except RuntimeError:
            if len(tensors) == 1:
                return [self._one(tensors[0])]
        return [self._one(t) for t in tensors]

    def twin(self) -> TorchvisionDecoder:
        return TorchvisionDecoder(*self._args)

    def _one(self, t: Any) -> Any:
        try:
            return self._decode_jpeg([t], mode=self._rgb, device=self._device)[0]
        except RuntimeError as exc:
            return f"corrupt or truncated JPEG: {str(exc).splitlines()[0]}"


# each made with (torch, device, max_batch)
DECODERS: dict[str, Callable[[Any, int, int], DeviceDecoder]] = {
    "nvimgcodec": NvImageCodecDecoder,
    "nvimgcodec-cuda": lambda torch, device, max_batch: NvImageCodecDecoder(torch, device, max_batch, hardware=False),
    "torchvision": TorchvisionDecoder,
}


class NoDecoder(RuntimeError):
    """No decoder of ``DECODERS`` works on this device; ``reasons`` has each one's."""

    def __init__(self, reasons: dict[str, str]) -> None:
        self.reasons = reasons
        super().__init__("no GPU JPEG decoder works here: " + "; ".join(f"{k}: {v}" for k, v in reasons.items())
                         + " (pip install nvidia-nvimgcodec-cu13 nvidia-nvjpeg, or torchvision's CUDA build)")


def probe_jpeg() -> bytes:
    """A 32x16 JPEG, 4:2:0, one colour."""
    from PIL import Image

    with io.BytesIO() as buf:
        Image.new("RGB", (32, 16), (200, 30, 90)).save(buf, format="JPEG")
        return buf.getvalue()


def open_decoder(torch: Any, device: int, names: tuple[str, ...] = tuple(DECODERS),
                 max_batch: int = 1) -> DeviceDecoder:
    """The first decoder of ``names`` that opens and decodes ``probe_jpeg`` to [3, 16, 32] on ``device``, made for
    batches of up to ``max_batch`` rows.

    Raises:
        NoDecoder: none did, with each one's reason.
    """
    reasons: dict[str, str] = {}
    data = probe_jpeg()
    for name in names:
        try:
            decoder = DECODERS[name](torch, device, max_batch)
            with torch.cuda.device(device):
                stream = torch.cuda.current_stream(device)
                out = decoder.decode([memoryview(bytearray(data))], stream)[0]
                stream.synchronize()
        # TypeError and AttributeError: another version of the decoder's library, with another API
        except (ImportError, RuntimeError, OSError, TypeError, AttributeError) as exc:
            reasons[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            continue
        if isinstance(out, str) or tuple(out.shape) != (3, 16, 32):
            reasons[name] = f"decoded a 32x16 JPEG to {out if isinstance(out, str) else tuple(out.shape)}"
            continue
        if reasons:
            log.info("JPEG decoder %s (%s)", name, "; ".join(f"{k}: {v}" for k, v in reasons.items()))
        return decoder
    raise NoDecoder(reasons)
