"""The photo benchmarks' photographs: real photographs that installed packages ship (no download), each cropped to
4:3 at its centre, resized to a benchmark size and saved as a JPEG of quality 90, cached on disk by size.

Sources: scikit-image's bundled samples, scikit-learn's ``load_sample_images``, matplotlib's ``grace_hopper.jpg``
(those three in the dev extra) and the nature photographs of Debian's ``mate-backgrounds``. tests/photoset.py
takes its photographs from ``sources`` too. On a machine without those packages (the GPU machine's image),
``python -m shmbroker.bench.photoset --export DIR`` here and ``SHMBROKER_PHOTO_DIR=DIR`` there give the same set.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from shmbroker.bench.common import BenchError, Figures, Progress

log = logging.getLogger(__name__)
SIZES: tuple[tuple[int, int], ...] = ((640, 480), (1280, 960), (1920, 1440))
QUALITY = 90
FORMAT_VERSION = 1  # part of the cache key: a change to how the set is made builds it again
# scikit-image's bundled photographs (colour and grey); cat() is chelsea() again, so it is not listed
SKIMAGE = ("astronaut", "camera", "chelsea", "coffee", "rocket", "hubble_deep_field", "coins", "moon", "clock",
           "immunohistochemistry", "retina", "brick", "grass", "gravel")
MATE_NATURE = Path("/usr/share/backgrounds/mate/nature")
PHOTO_DIR_ENV = "SHMBROKER_PHOTO_DIR"  # a folder that ``export`` wrote: the set from its files instead
MISSING_HINT = ("install the dev extra (pip install 'shmbroker[dev]': scikit-image, scikit-learn, matplotlib) or "
                "Debian's mate-backgrounds")

Size = tuple[int, int]


def _rgb(arr: object) -> Image.Image:
    return Image.fromarray(np.asarray(arr)).convert("RGB")


def sources(strict: bool = False) -> dict[str, Callable[[], Image.Image]]:
    """Every available photograph's loader by source name (``skimage/astronaut``, ``mate/Wood``, ...).

    ``strict``: a missing scikit-image, scikit-learn or matplotlib raises ImportError (tests must not shrink their
    set in silence); otherwise its photographs are left out.
    """
    exported = os.environ.get(PHOTO_DIR_ENV)
    if exported:
        return _exported(Path(exported))
    found: dict[str, Callable[[], Image.Image]] = {}
    for group in (_skimage, _sklearn, _matplotlib):
        try:
            found.update(group())
        except ImportError:
            if strict:
                raise
    if MATE_NATURE.is_dir():
        for path in sorted(MATE_NATURE.glob("*.jpg")):
            found[f"mate/{path.stem}"] = functools.partial(lambda p: Image.open(p).convert("RGB"), path)
    return found


def _exported(folder: Path) -> dict[str, Callable[[], Image.Image]]:
    """The photographs ``export`` wrote to ``folder``, by source name; BenchError naming the variable if none."""
    files = sorted(folder.glob("*__*.png")) + sorted(folder.glob("*__*.jpg"))
    if not files:
        raise BenchError(f"{PHOTO_DIR_ENV}={folder}: no photographs there; write them with "
                         f"python -m shmbroker.bench.photoset --export {folder}")
    return {path.stem.replace("__", "/", 1): functools.partial(lambda p: Image.open(p).convert("RGB"), path)
            for path in files}


def export(folder: Path) -> int:
    """Write every photograph of ``sources(strict=True)`` to ``folder``: the packages' as lossless PNG, the files
    as they are on disk; returns how many."""
    folder.mkdir(parents=True, exist_ok=True)
    loaders = sources(strict=True)
    for name, load in loaders.items():
        group, stem = name.split("/", 1)
        if group == "mate":
            shutil.copyfile(MATE_NATURE / f"{stem}.jpg", folder / f"{group}__{stem}.jpg")
        else:
            load().save(folder / f"{group}__{stem}.png")
    return len(loaders)


def _skimage() -> dict[str, Callable[[], Image.Image]]:
    from skimage import data as skdata

    found: dict[str, Callable[[], Image.Image]] = {
        f"skimage/{name}": functools.partial(lambda n: _rgb(getattr(skdata, n)()), name) for name in SKIMAGE}
    found["skimage/motorcycle"] = lambda: _rgb(skdata.stereo_motorcycle()[0])  # type: ignore[no-untyped-call]
    return found


def _sklearn() -> dict[str, Callable[[], Image.Image]]:
    from sklearn.datasets import load_sample_images

    return {f"sklearn/{name}": functools.partial(lambda i: _rgb(load_sample_images().images[i]), k)
            for k, name in enumerate(("china", "flower"))}


def _matplotlib() -> dict[str, Callable[[], Image.Image]]:
    import matplotlib

    hopper = Path(matplotlib.get_data_path()) / "sample_data" / "grace_hopper.jpg"
    return {"matplotlib/grace_hopper": lambda: Image.open(hopper).convert("RGB")}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The photo set's options (``shmbroker bench --photos``, ``python -m shmbroker.bench.photos``)."""
    ap.add_argument("--sizes", default="", metavar="WxH,...",
                    help="--photos: the photo sizes (default " + ",".join(map(size_name, SIZES)) + ")")
    ap.add_argument("--photo-cache", default=None, metavar="DIR",
                    help="--photos: where the photo set is cached (default $XDG_CACHE_HOME/shmbroker/photoset, "
                         "~/.cache/... without it)")


def parse_sizes(text: str) -> list[Size]:
    """``"640x480,1280x960"`` as [(640, 480), (1280, 960)]; BenchError names a bad one."""
    out: list[Size] = []
    for part in (p.strip() for p in text.split(",")):
        w, x, h = part.lower().partition("x")
        if not (x and w.isdigit() and h.isdigit() and 16 <= int(w) <= 16384 and 16 <= int(h) <= 16384):
            raise BenchError(f"--sizes: {part!r} is not WIDTHxHEIGHT (16 to 16384 each), as in 640x480")
        if (int(w), int(h)) not in out:
            out.append((int(w), int(h)))
    if not out:
        raise BenchError("--sizes: no size given")
    return out


def size_name(size: Size) -> str:
    return f"{size[0]}x{size[1]}"


def fit(img: Image.Image, size: Size) -> Image.Image:
    """``img`` cropped at its centre to the aspect of ``size``, then resized to it (Lanczos)."""
    w, h = size
    iw, ih = img.size
    if iw * h > ih * w:  # wider than the target: trim the sides
        cw, ch = round(ih * w / h), ih
    else:
        cw, ch = iw, round(iw * h / w)
    left, top = (iw - cw) // 2, (ih - ch) // 2
    return img.crop((left, top, left + cw, top + ch)).resize(size, Image.Resampling.LANCZOS)


def default_cache() -> Path:
    """``$XDG_CACHE_HOME/shmbroker/photoset`` (``~/.cache/...`` without it)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "shmbroker" / "photoset"


def cache_key(names: list[str], size: Size) -> str:
    """The folder name of one size's set: the size, and a digest of the sources, quality and format version."""
    digest = hashlib.sha256(json.dumps([FORMAT_VERSION, QUALITY, sorted(names)]).encode()).hexdigest()[:12]
    return f"{size_name(size)}-q{QUALITY}-{digest}"


@dataclass(frozen=True)
class PhotoSet:
    """One size's JPEG files, in source-name order."""

    size: Size
    paths: tuple[Path, ...]
    folder: Path

    def load(self) -> list[bytes]:
        return [p.read_bytes() for p in self.paths]

    def figures(self) -> Figures:
        sizes = [p.stat().st_size for p in self.paths]
        return {"images": len(sizes), "width": self.size[0], "height": self.size[1], "quality": QUALITY,
                "mean_bytes": round(sum(sizes) / len(sizes)), "min_bytes": min(sizes), "max_bytes": max(sizes),
                "folder": str(self.folder)}


def _cached(folder: Path, size: Size) -> PhotoSet | None:
    try:
        manifest = json.loads((folder / "manifest.json").read_text())
    except (OSError, ValueError):
        return None
    paths = tuple(folder / name for name in manifest.get("files", []))
    if not paths or not all(p.is_file() for p in paths):
        return None
    return PhotoSet(size, paths, folder)


def build(sizes: list[Size], cache: Path | None, progress: Progress) -> dict[Size, PhotoSet]:
    """Each size's set, from the cache where it is there, else made from ``sources()`` and cached (written into a
    temporary folder first, so an interrupted build leaves no half set). BenchError when no photograph is found."""
    loaders = sources()
    if not loaders:
        raise BenchError(f"no photographs found for the photo set: {MISSING_HINT}")
    root = cache or default_cache()
    names = sorted(loaders)
    out: dict[Size, PhotoSet] = {}
    missing = []
    for size in sizes:
        found = _cached(root / cache_key(names, size), size)
        if found is None:
            missing.append(size)
        else:
            out[size] = found
    if missing:
        progress.note(f"making the photo set ({len(names)} photographs x {', '.join(map(size_name, missing))}) "
                      f"in {root}")
        images = {}
        for k, name in enumerate(names):
            images[name] = loaders[name]()
            if (k + 1) % 8 == 0 or k + 1 == len(names):
                progress.tick(f"loaded {k + 1}/{len(names)} photographs")
        for size in missing:
            out[size] = _write(root / cache_key(names, size), size, images)
            progress.tick(f"{size_name(size)}: {len(names)} JPEGs written")
    else:
        progress.note(f"photo set from the cache {root}")
    return {size: out[size] for size in sizes}


def _write(folder: Path, size: Size, images: dict[str, Image.Image]) -> PhotoSet:
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        files = []
        for k, (name, img) in enumerate(sorted(images.items())):
            file = f"{k:03d}-{name.replace('/', '-')}.jpg"
            fit(img, size).save(tmp / file, format="JPEG", quality=QUALITY)
            files.append(file)
        (tmp / "manifest.json").write_text(json.dumps({"size": list(size), "quality": QUALITY,
                                                       "sources": sorted(images), "files": files}, indent=1))
        if folder.exists():  # a broken set (no manifest, a file missing): replaced whole
            shutil.rmtree(folder)
        try:
            tmp.rename(folder)
        except OSError:  # another bench made the same set meanwhile: theirs serves
            if _cached(folder, size) is None:
                raise
            shutil.rmtree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    found = _cached(folder, size)
    if found is None:
        raise BenchError(f"the photo set written to {folder} cannot be read back")
    return found


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ap = argparse.ArgumentParser(prog="python -m shmbroker.bench.photoset",
                                 description="write the photographs for a machine without their packages")
    ap.add_argument("--export", type=Path, required=True, metavar="DIR")
    folder = ap.parse_args().export
    log.info("wrote %d photographs to %s: use them with %s=%s", export(folder), folder, PHOTO_DIR_ENV, folder)
