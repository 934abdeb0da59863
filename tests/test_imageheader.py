"""Reading an encoded image's header without decoding it (gpu_worker/imageheader.py): real photographs, and
the bad rows every worker must refuse, with the reasons a CPU worker gives."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from shmbroker.bench.photoset import MATE_NATURE
from shmbroker.gpu_worker.imageheader import JPEG, PNG, Header, read_header
from shmbroker.gpu_worker.photos import ImageError
from tests import photoset

LIMIT = 20_000_000
SETTING = "models.nsfw_photo.max_image_pixels"


def _read(data: bytes) -> Header:
    return read_header(memoryview(data), LIMIT, SETTING)


def _save(img: Image.Image, **kw: object) -> bytes:
    with io.BytesIO() as buf:
        img.save(buf, **kw)  # type: ignore[arg-type]
        return buf.getvalue()


def test_real_photographs_give_their_size() -> None:
    for name, img in sorted(photoset.photos().items())[:10]:
        assert _read(photoset.jpeg(img)) == Header(JPEG, img.width, img.height, True), name
        assert _read(photoset.png(img)) == Header(PNG, img.width, img.height, False), name
    if MATE_NATURE.is_dir():  # files as cameras and editors wrote them (EXIF, thumbnails)
        for path in sorted(MATE_NATURE.glob("*.jpg"))[:5]:
            with Image.open(path) as img:
                size = img.size
            head = _read(path.read_bytes())
            assert (head.kind, head.width, head.height) == (JPEG, *size), path


def test_which_jpegs_a_gpu_decoder_takes() -> None:
    img = photoset.photos()["skimage/astronaut"]
    assert _read(_save(img, format="JPEG", progressive=True)).gpu  # SOF2
    assert _read(_save(img.convert("L"), format="JPEG")).gpu  # one component
    cmyk = _read(_save(img.convert("CMYK"), format="JPEG"))  # four: decoded on the CPU, as Pillow converts it
    assert cmyk.kind == JPEG and not cmyk.gpu


@pytest.mark.parametrize("name", sorted(photoset.bad_rows()))
def test_bad_rows_are_refused_with_the_cpu_workers_reason(name: str) -> None:
    """Every bad row of tests/photoset.py but a truncated PNG (whose header is whole: its decode fails) is
    refused from its header, naming what a CPU worker names."""
    data, reason = photoset.bad_rows()[name]
    if name == "truncated png":
        assert _read(data).kind == PNG
        return
    with pytest.raises(ImageError, match=reason):
        _read(data)


def test_the_pixel_limit_names_its_setting() -> None:
    data = photoset.jpeg(Image.new("RGB", (5000, 4500)), 50)
    with pytest.raises(ImageError) as err:
        _read(data)
    assert str(err.value) == f"5000x4500 = 22500000 pixels exceeds {SETTING} ({LIMIT})"
    assert read_header(memoryview(data), 22_500_000, SETTING).width == 5000  # at the limit: taken


def test_truncation_anywhere_is_caught() -> None:
    good = photoset.jpeg(photoset.photos()["skimage/coffee"])
    for cut in (3, 20, 100, 700, len(good) // 3, len(good) - 2):
        with pytest.raises(ImageError, match="JPEG"):
            _read(good[:cut])


def test_an_end_marker_inside_a_header_segment_does_not_hide_truncation() -> None:
    """An APP1 segment (an EXIF thumbnail, say) holding FF D9 before the scan: the cut file is still refused."""
    good = photoset.jpeg(photoset.photos()["skimage/coffee"])
    app1 = b"\xff\xe1" + (2 + 8).to_bytes(2, "big") + b"\xff\xd8\x00\x00\x00\x00\xff\xd9"
    with_thumb = good[:2] + app1 + good[2:]
    assert _read(with_thumb).gpu
    with pytest.raises(ImageError, match="no end-of-image marker"):
        _read(with_thumb[: len(with_thumb) // 2])


def test_trailing_bytes_after_the_image_are_allowed() -> None:
    """As libjpeg allows them: some cameras pad their files."""
    good = photoset.jpeg(photoset.photos()["skimage/coffee"])
    assert _read(good + bytes(10_000)).gpu


def test_headers_that_lie_are_refused() -> None:
    good = bytearray(photoset.jpeg(Image.new("RGB", (64, 48), (1, 2, 3))))
    sof = good.index(b"\xff\xc0")
    zero = bytearray(good)
    zero[sof + 5 : sof + 7] = b"\x00\x00"
    with pytest.raises(ImageError, match="frame of 64x0 pixels"):
        _read(bytes(zero))
    no_frame = bytearray(good)
    no_frame[sof + 1] = 0xE5  # the frame header becomes an APP5 segment
    with pytest.raises(ImageError, match="a scan before any frame header"):
        _read(bytes(no_frame))
    with pytest.raises(ImageError, match="runs past the end"):
        _read(bytes(good[: sof + 4]) + b"\xff" * 8)
    with pytest.raises(ImageError, match="corrupt or truncated PNG"):
        _read(photoset.png(Image.new("RGB", (8, 8)))[:20])
