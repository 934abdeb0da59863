#!/usr/bin/env bash
# Where the host's time goes under (c): py-spy samples the worker and one client process while bench.gpu's
# (c) runs, and the bench reports each worker thread's CPU microseconds per request (worker_cpu_us_per_request).
#   bash bench/h200_profile.sh --engines inductor --inductor PKG --max-batch 128 --in-flight 24
# Needs py-spy (pip install py-spy). Writes to $OUT: the bench's JSON and table, and py-spy's collapsed stacks
# (worker.folded, client.folded: one line per stack, "frame;frame;... count"), summed by bench/folded.py.
# PYSPY_ARGS adds py-spy options: "--gil" samples only the thread that holds the GIL, "--idle" waiting ones too.
set -uo pipefail
out=${OUT:-/tmp/h200}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
seconds=${PROFILE_SECONDS:-8}
python3 -m shmbroker.bench.gpu --only broker --duration $((seconds + 6)) --json --out "$out/profile_bench.json" "$@" \
  > "$out/profile_bench.txt" 2>&1 &
bench=$!
# the clients start once the broker is ready; py-spy starts after their warm-up (20 requests, then 1 s)
until grep -q "broker ready in" "$out/profile_bench.txt" 2>/dev/null; do
  kill -0 "$bench" 2>/dev/null || { echo "the bench ended before its broker was ready"; cat "$out/profile_bench.txt"; exit 1; }
  sleep 0.2
done
sleep 4
worker=$(pgrep -n -x shmb-worker-0) client=$(pgrep -n -x shmb-bench-0)
echo "worker pid $worker, client pid $client"
read -r -a pyspy_extra <<< "${PYSPY_ARGS:-}"
py-spy record --pid "$worker" --duration "$seconds" --rate 500 --format raw --threads --nonblocking "${pyspy_extra[@]}" \
  --output "$out/worker.folded" > "$out/pyspy_worker.log" 2>&1 &
py-spy record --pid "$client" --duration "$seconds" --rate 500 --format raw --threads --nonblocking "${pyspy_extra[@]}" \
  --output "$out/client.folded" > "$out/pyspy_client.log" 2>&1 &
wait
tail -n 30 "$out/profile_bench.txt"
for f in worker client; do
  echo "== $f =="; tail -n 3 "$out/pyspy_$f.log"
  [ -s "$out/$f.folded" ] && python3 -m shmbroker.bench.folded "$out/$f.folded" | head -n 40
done
