#!/usr/bin/env bash
# Paired GPU bench runs of two builds in one call on the GPU machine: A is this checkout, B a shmbroker wheel
# installed into $B_SITE (pip install --no-deps --target "$B_SITE" B.whl). They alternate ROUNDS times with the
# same bench options; B runs from another directory, since `python -m` puts the current one first on sys.path.
# B_ARGS adds options to B's runs only (a config that only B reads, say). Prints one line per run; the JSON
# documents go to $OUT/runs.tgz.
#   B_SITE=/tmp/site-v ROUNDS=2 bash bench/h200_variants.sh --quick --engines torch --only broker --max-batch 256
set -uo pipefail
out=${OUT:-/tmp/h200}
runs="$out/runs"
mkdir -p "$runs"
export PYTHONUNBUFFERED=1
repo=$PWD
base=${PYTHONPATH:-}
read -r -a b_extra <<< "${B_ARGS:-}"
for round in $(seq 1 "${ROUNDS:-2}"); do
  for side in A B; do
    doc="$runs/${side}_$round.json"
    if [ "$side" = A ]; then
      (cd "$repo" && PYTHONPATH="$base:$repo" python3 -m shmbroker.bench.gpu --json --out "$doc" "$@") \
        > "$runs/${side}_$round.txt" 2>&1
    else
      (cd /tmp && PYTHONPATH="$B_SITE:$base" python3 -m shmbroker.bench.gpu --json --out "$doc" "$@" "${b_extra[@]}") \
        > "$runs/${side}_$round.txt" 2>&1
    fi
    echo "round $round $side: exit $?"
  done
done
PYTHONPATH="$base:$repo" python3 -m shmbroker.bench.gpu_summary "$runs"
tar czf "$out/runs.tgz" -C "$out" runs && rm -rf "$runs"
