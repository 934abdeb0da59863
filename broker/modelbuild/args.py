"""The options of ``shmbroker build`` and ``check-precision``, kept free of heavy imports: every ``shmbroker``
command builds its parser, and only these two need onnx and the conversion tools."""

from __future__ import annotations

import argparse

from shmbroker.broker.common.engines import built_engines

PRECISIONS = ("fp32", "fp16", "int8")
CALIB_METHODS = ("entropy", "minmax", "percentile")
PREPROCESS = ("imagenet", "opennsfw", "pixels")  # the keys of calibration.PREPROCESS
HARDWARE_COMPAT = ("none", "ampere+")
DEFAULT_BATCH_SIZES = "1,8,32"


def add_build_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("model", help="the float32 ONNX model")
    ap.add_argument("-o", "--out", required=True,
                    help="output folder (created): converted ONNX, build record, plan or package")
    ap.add_argument("--engine", choices=built_engines(), default="tensorrt",
                    help="tensorrt: a TensorRT plan (needs the full builder); inductor: an AOTInductor package "
                         "(needs PyTorch with CUDA and Triton)")
    ap.add_argument("--precision", choices=PRECISIONS, default="fp16",
                    help="fp16 (default), fp32, or int8 (tensorrt only, with --calib-data)")
    ap.add_argument("--calib-data", default="", help="int8: an image folder, a .npy or a .npz file")
    ap.add_argument("--calib-method", choices=CALIB_METHODS, default="entropy",
                    help="int8 calibration method: entropy (default), minmax or percentile")
    ap.add_argument("--preprocess", choices=PREPROCESS, default="opennsfw",
                    help="how image files become model input (default: opennsfw, the nsfw model's)")
    ap.add_argument("--profile", action="append", default=[], metavar="NAME:MIN,OPT,MAX",
                    help="shapes of a dynamic input: batch sizes (1,8,16) or full shapes (1x3x224x224,...)")
    ap.add_argument("--max-batch", type=int, default=8, help="batch range 1..N of inputs without --profile")
    ap.add_argument("--streams", type=int, default=1, help="optimization profiles, one per concurrent context")
    ap.add_argument("--workspace", type=int, default=1024, metavar="MIB", help="builder workspace pool limit")
    ap.add_argument("--timing-cache", default="", metavar="FILE", help="read before and written after the build")
    ap.add_argument("--version-compatible", action="store_true", help="a plan the lean runtime can run")
    ap.add_argument("--hardware-compat", choices=HARDWARE_COMPAT, default="none",
                    help="none (default): this GPU's architecture only; ampere+: any Ampere or later GPU")
    ind = ap.add_argument_group("inductor", "options of --engine inductor")
    ind.add_argument("--batch-sizes", default=DEFAULT_BATCH_SIZES, metavar="N,N,...",
                     help=f"one compiled model per batch bucket; a batch runs in the smallest bucket that holds it, "
                          f"the largest bucket bounds the model's max_batch (default {DEFAULT_BATCH_SIZES})")
    ind.add_argument("--dynamic-batch", action="store_true",
                     help="one model with a dynamic batch up to the largest of --batch-sizes, instead of buckets")
    ind.add_argument("--autotune", choices=("max", "default"), default="max",
                     help="max: inductor's max-autotune (minutes per bucket, the fastest kernels); default: "
                          "its heuristics (quicker builds)")
    ind.add_argument("--cache-dir", default="", metavar="DIR",
                     help="inductor's FX, autotuning and Triton caches, reused by later builds "
                          "(default $XDG_CACHE_HOME/shmbroker/inductor)")


def add_check_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("reference", help="the float32 ONNX model")
    ap.add_argument("candidates", nargs="+", help="converted ONNX models (fp16, int8) to compare with it")
    ap.add_argument("--eval-data", required=True,
                    help="an image folder, a .npy or a .npz file, disjoint from the calibration data")
    ap.add_argument("--preprocess", choices=PREPROCESS, default="opennsfw",
                    help="how image files become model input (default: opennsfw, the nsfw model's)")
    ap.add_argument("--batch", type=int, default=8, help="rows per run")
    ap.add_argument("--seconds", type=float, default=2.0, help="throughput: run each model at least this long")
    ap.add_argument("--threads", type=int, default=0, help="ONNX Runtime intra-op threads (0: its default)")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
