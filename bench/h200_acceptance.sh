#!/usr/bin/env bash
# The GPU acceptance on the GPU machine, in one call: the GPU tests, then the GPU bench at the given
# in-flight counts (16 client processes each), then one request at a time (1 process, 1 in flight). Prints a
# short table at the end; logs and JSON go to $OUT. BENCH_ARGS adds options to every bench run. One request
# at a time runs three times: with Client.call chains, with Client.infer (--api infer) and with zero-copy
# requests (--api request: the input written in the slot before the timing starts).
#   bash bench/h200_acceptance.sh 8 7        (after installing the carried wheels, see ../shared/device)
#   BENCH_ARGS="--quick --max-batch 256 --streams 2" bash bench/h200_acceptance.sh 40 48   (eager at its best batch)
#   INDUCTOR=out/open-nsfw.fp16.inductor.pt2 bash bench/h200_acceptance.sh 8    (eager and inductor columns)
set -uo pipefail
out=${OUT:-/tmp/h200}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
engines=()
[ -n "${INDUCTOR:-}" ] && engines=(--engines torch,inductor --inductor "$INDUCTOR")
python3 -m pytest -q -p no:cacheprovider -rs tests/gpu tests/test_engines_gpu_errors.py 2>&1 | tee "$out/gpu_tests.log"
tests_rc=${PIPESTATUS[0]}
read -r -a extra <<< "${BENCH_ARGS:-}"
for n in "$@"; do
  python3 -m shmbroker.bench.gpu --json --out "$out/bench_if$n.json" --in-flight "$n" --log-dir "$out/logs_if$n" \
    "${engines[@]}" "${extra[@]}" > "$out/bench_if$n.txt" 2>&1
  echo "bench in-flight $n: exit $?"
done
python3 -m shmbroker.bench.gpu --json --out "$out/bench_lone.json" --only limit,broker --processes 1 --in-flight 1 \
  "${engines[@]}" "${extra[@]}" > "$out/bench_lone.txt" 2>&1
echo "bench one request at a time (Client.call): exit $?"
python3 -m shmbroker.bench.gpu --json --out "$out/bench_lone_infer.json" --only limit,broker --processes 1 \
  --in-flight 1 --api infer "${engines[@]}" "${extra[@]}" > "$out/bench_lone_infer.txt" 2>&1
echo "bench one request at a time (Client.infer): exit $?"
python3 -m shmbroker.bench.gpu --json --out "$out/bench_lone_request.json" --only limit,broker --processes 1 \
  --in-flight 1 --api request "${engines[@]}" "${extra[@]}" > "$out/bench_lone_request.txt" 2>&1
echo "bench one request at a time (Client.request): exit $?"
echo
echo "== summary =="
tail -n 1 "$out/gpu_tests.log"
echo "gpu tests exit code: $tests_rc"
python3 - "$out" "$@" lone lone_infer lone_request <<'PY'
import json, sys
out, counts = sys.argv[1], sys.argv[2:]
print(f"{'in flight':>9} {'engine':>9} {'(a) img/s':>10} {'(c) img/s':>10} {'c/a':>6} {'GPU %':>6} {'p99 ms':>7} "
      f"{'bound':>7} {'p50 ms':>7} {'lone bound':>10}")
for n in counts:
    try:
        doc = json.load(open(f"{out}/bench_{'' if n.startswith('lone') else 'if'}{n}.json"))
    except (OSError, ValueError) as exc:
        print(f"{n:>9} no result: {exc}")
        continue
    for engine, m in doc.get("measurements", {}).get("engines", {}).items():
        t = doc.get("targets", {}).get(engine, {})
        def val(name, key="value"):
            v = t.get(name, {})
            return v.get(key) if isinstance(v, dict) else None
        a = m.get("limit", {}).get("items_per_s")
        c = m.get("broker", {}).get("per_s")
        print(f"{n:>9} {engine:>9} {a!s:>10.10} {c!s:>10.10} {val('c_over_a')!s:>6.6} "
              f"{val('gpu_busy_pct_c')!s:>6.6} {val('p99_ms_c')!s:>7.7} {val('p99_ms_c', 'target')!s:>7.7} "
              f"{val('p50_ms_lone')!s:>7.7} {val('p50_ms_lone', 'target')!s:>10.10}")
    print(f"{'':>9} failures: {doc.get('failures')}")
PY
