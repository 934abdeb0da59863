"""An encoded image's header read on the CPU without decoding a pixel: its format, its size checked against the
model's pixel limit, and for a JPEG whether a GPU decoder takes it (``Header.gpu``) and whether its stream ends.

A GPU worker reads each row's header before its batched decode, so that a bomb is refused before the decoder
allocates and a bad row is named alone; the texts are gpu_worker/photos.py's, so every kind of worker answers
one bad image with the same reason.
"""

from __future__ import annotations

from dataclasses import dataclass

from shmbroker.gpu_worker.photos import JPEG_MAGIC, PNG_MAGIC, PNG_SIZE_AT, ImageError, too_many

JPEG = "jpeg"
PNG = "png"


def _u16(data: memoryview | bytes, pos: int) -> int:
    """A big-endian u16 of a JPEG segment (the file format's, not a wire layout); two indexings, no slice, since
    the runner thread reads every row's headers before its batch decodes."""
    return (data[pos] << 8) | data[pos + 1]


# start-of-frame markers: C0-CF but DHT (C4), JPG (C8) and DAC (CC)
_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
_GPU_SOF = frozenset({0xC0, 0xC1, 0xC2})  # Huffman baseline, extended and progressive: nvJPEG decodes these
_STANDALONE = frozenset({0x01, *range(0xD0, 0xD8)})  # TEM and RSTn carry no length
_EOI_TAIL = 4096  # the end-of-image marker is looked for here first; a file with more trailing bytes is searched


@dataclass(frozen=True, slots=True)
class Header:
    """What a row's header says: ``kind`` JPEG or PNG, its size, and whether a GPU decoder takes it (a JPEG of
    8-bit Huffman coding in 1 or 3 components; the others decode on the CPU)."""

    kind: str
    width: int
    height: int
    gpu: bool


def read_header(data: memoryview, max_pixels: int, pixels_setting: str) -> Header:
    """The row's header, checked; ImageError says why the row cannot be used."""
    head = bytes(data[:8])
    if head.startswith(JPEG_MAGIC):
        return _jpeg(data, max_pixels, pixels_setting)
    if head == PNG_MAGIC:
        return _png(data, max_pixels, pixels_setting)
    raise ImageError("not a JPEG or PNG image (unknown signature)")


def _png(data: memoryview, max_pixels: int, setting: str) -> Header:
    if len(data) < 24 or bytes(data[12:16]) != b"IHDR":
        raise ImageError("corrupt or truncated PNG: no IHDR chunk first")
    width = int.from_bytes(data[PNG_SIZE_AT : PNG_SIZE_AT + 4], "big")
    height = int.from_bytes(data[PNG_SIZE_AT + 4 : PNG_SIZE_AT + 8], "big")
    if width * height > max_pixels:
        raise too_many(width, height, max_pixels, setting)
    return Header(PNG, width, height, False)


def _jpeg(data: memoryview, max_pixels: int, setting: str) -> Header:
    """Walk the marker segments from SOI to the first SOS: the frame header (SOF) must come before it, every
    segment must fit the file, and an end-of-image marker must follow the scan."""
    n = len(data)
    pos = 2
    frame: tuple[int, int, int, int, int] | None = None  # marker, precision, height, width, components
    while True:
        if pos + 4 > n:
            raise ImageError(f"corrupt or truncated JPEG: the headers end at byte {n}, before any scan")
        if data[pos] != 0xFF:
            raise ImageError(f"corrupt JPEG header: no marker at byte {pos}")
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte before a marker
            pos += 1
            continue
        if marker in _STANDALONE:
            pos += 2
            continue
        if marker == 0xD9:
            raise ImageError("corrupt JPEG header: end of image before any scan")
        length = _u16(data, pos + 2)
        if length < 2 or pos + 2 + length > n:
            raise ImageError(f"corrupt or truncated JPEG: segment {marker:#04x} at byte {pos} runs past the end")
        if marker in _SOF:
            if length < 8:
                raise ImageError(f"corrupt JPEG header: frame header of {length} bytes")
            height, width = _u16(data, pos + 5), _u16(data, pos + 7)
            frame = (marker, data[pos + 4], height, width, data[pos + 9])
        elif marker == 0xDA:
            break
        pos += 2 + length
    if frame is None:
        raise ImageError("corrupt JPEG header: a scan before any frame header")
    marker, precision, height, width, components = frame
    if width == 0 or height == 0:
        raise ImageError(f"corrupt JPEG header: frame of {width}x{height} pixels")
    if width * height > max_pixels:
        raise too_many(width, height, max_pixels, setting)
    if not _ends(data, pos):
        raise ImageError("corrupt or truncated JPEG: no end-of-image marker after the scan")
    gpu = marker in _GPU_SOF and precision == 8 and components in (1, 3)
    return Header(JPEG, width, height, gpu)


def _ends(data: memoryview, scan: int) -> bool:
    """Whether an EOI marker (FF D9) follows the scan that starts at ``scan``: entropy-coded data stuffs every
    FF it holds, so the marker cannot occur inside it."""
    n = len(data)
    if n - scan >= 2 and data[n - 2] == 0xFF and data[n - 1] == 0xD9:
        return True  # where encoders put it: the file's last two bytes
    tail = bytes(data[max(scan, n - _EOI_TAIL) :])
    return b"\xff\xd9" in tail or b"\xff\xd9" in bytes(data[scan:])
