#!/usr/bin/env bash
# GPU bench runs of one build under several settings, in one call on the GPU machine: each argument is
# NAME=OPTIONS, the bench options of one run (quote it); COMMON options go to every run. Prints one line per
# run (with the window's batches by size); the JSON documents go to $OUT/matrix.tgz.
#   COMMON="--quick --engines torch --max-batch 256 --only broker" bash bench/h200_matrix.sh \
#     "two48=--streams 2 --in-flight 48" "two48-serial=--streams 2 --in-flight 48 --set serial_compute=true"
set -uo pipefail
out=${OUT:-/tmp/h200}
runs="$out/matrix"
mkdir -p "$runs"
export PYTHONUNBUFFERED=1
read -r -a common <<< "${COMMON:-}"
spec_names=()
for spec in "$@"; do
  name=${spec%%=*}
  spec_names+=("$name")
  read -r -a opts <<< "${spec#*=}"
  python3 -m shmbroker.bench.gpu --json --out "$runs/$name.json" "${common[@]}" "${opts[@]}" > "$runs/$name.txt" 2>&1
  echo "$name: exit $? at $(date -u +%T)"
done
python3 -m shmbroker.bench.gpu_summary "$runs" "${spec_names[@]}"
tar czf "$out/matrix.tgz" -C "$out" matrix && rm -rf "$runs"
