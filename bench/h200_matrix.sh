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
for spec in "$@"; do
  name=${spec%%=*}
  read -r -a opts <<< "${spec#*=}"
  python3 -m shmbroker.bench.gpu --json --out "$runs/$name.json" "${common[@]}" "${opts[@]}" > "$runs/$name.txt" 2>&1
  echo "$name: exit $? at $(date -u +%T)"
done
python3 - "$runs" "$@" <<'PY'
import json, os, sys
runs, names = sys.argv[1], [a.split("=", 1)[0] for a in sys.argv[2:]]
print(f"{'run':>16} {'(c) img/s':>10} {'c/a':>6} {'GPU %':>6} {'p50 ms':>7} {'p99 ms':>7} {'mean batch':>10}  batches by size")
for name in names:
    try:
        doc = json.load(open(os.path.join(runs, f"{name}.json")))
    except (OSError, ValueError) as exc:
        print(f"{name:>16} no result: {exc}")
        continue
    for engine, m in doc.get("measurements", {}).get("engines", {}).items():
        c = m.get("broker", {})
        lat, st = c.get("latency", {}), c.get("stages", {})
        t = doc.get("targets", {}).get(engine, {}).get("c_over_a", {}).get("value")
        print(f"{name:>16} {c.get('per_s')!s:>10.10} {t!s:>6.6} {c.get('gpu_busy_pct')!s:>6.6} "
              f"{lat.get('p50_us', 0) / 1e3:>7.2f} {lat.get('p99_us', 0) / 1e3:>7.2f} {st.get('mean_batch')!s:>10.10}  "
              f"{st.get('batch_sizes')}")
    if doc.get("failures"):
        print(f"{'':>16} failures: {doc['failures']}")
PY
tar czf "$out/matrix.tgz" -C "$out" matrix && rm -rf "$runs"
