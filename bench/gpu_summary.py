"""One line per GPU bench JSON document (``bench.gpu --json``): (c) images/s, (c)/(a), GPU busy (NVML), the
event-timed compute's share of the window, p50, p99 and its bound (where (a) ran too), the mean batch and the
window's batches by size. The GPU machine's scripts (h200_acceptance.sh and others) print their runs with it.

    python3 -m shmbroker.bench.gpu_summary DIR [NAME ...]    (NAME.json in DIR, in that order; else every *.json)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

HEADER = (f"{'run':>16} {'engine':>9} {'(c) img/s':>10} {'c/a':>6} {'GPU %':>6} {'comp %':>6} {'p50 ms':>7} "
          f"{'p99 ms':>7} {'bound':>6} {'mean batch':>10}  batches by size")


def lines(name: str, doc: dict[str, Any]) -> list[str]:
    """The lines of one document: one per engine, then its failures if any."""
    out = []
    for engine, m in doc.get("measurements", {}).get("engines", {}).items():
        c = m.get("broker", {})
        lat, st = c.get("latency", {}), c.get("stages", {})
        targets = doc.get("targets", {}).get(engine, {})
        ratio = targets.get("c_over_a", {}).get("value")
        bound = targets.get("p99_ms_c", {}).get("bound_ms") or "-"  # the p99 bound, where (a) ran in the same run
        out.append(f"{name:>16} {engine:>9} {c.get('per_s')!s:>10.10} {ratio!s:>6.6} {c.get('gpu_busy_pct')!s:>6.6} "
                   f"{st.get('compute_busy_pct')!s:>6.6} "
                   f"{lat.get('p50_us', 0) / 1e3:>7.2f} {lat.get('p99_us', 0) / 1e3:>7.2f} {bound!s:>6.6} "
                   f"{st.get('mean_batch')!s:>10.10}  {st.get('batch_sizes')}")
        out += _cpu_line(c)
    if doc.get("failures"):
        out.append(f"{'':>16} failures: {doc['failures']}")
    return out


def _cpu_line(c: dict[str, Any]) -> list[str]:
    """Each worker thread's CPU us a request and its share of a core at the window's rate, and each client
    process's: a thread near 100 % is the host path's ceiling; then how long and how often the worker's threads
    waited for a core: other processes holding the cores."""
    rate = c.get("per_s") or 0
    parts = []
    for threads in (c.get("worker_cpu_us_per_request") or {}).values():
        if not isinstance(threads, dict):
            continue
        busiest = [(k, v) for k, v in threads.items() if k != "total"][:5]
        parts += [f"{k} {v:.1f} us ({v * rate / 1e4:.0f} %)" for k, v in busiest]
        if "total" in threads:
            parts.append(f"worker total {threads['total']:.1f} us")
    client, procs = c.get("client_cpu_us_per_request"), c.get("clients") or 0
    if client and procs:
        parts.append(f"client process {client:.0f} us ({client * rate / procs / 1e4:.0f} % each)")
    outside = c.get("outside_worker_ms")
    if outside is not None:
        parts.append(f"{outside:.2f} ms a request outside the worker's stages ({outside * rate / 1e3:.0f} requests)")
    if c.get("client_preempted_per_1k_requests") is not None:
        parts.append(f"clients preempted {c['client_preempted_per_1k_requests']} per 1000 requests")
    bursts = c.get("answer_bursts") or {}
    if bursts:
        parts.append(f"answers come {bursts['answers_per_burst']} a burst, {bursts['gaps_within_1ms_pct']} % of "
                     f"the gaps within 1 ms, {bursts['gaps_1_to_4ms_pct']} % within 1-4 ms")
    host = c.get("host_cpu") or {}
    if host:
        parts.append(f"machine {host.get('busy_pct')} % busy, {host.get('steal_pct')} % stolen")
    for key, label in (("worker_runq_us_per_request", "waited for a core, us"),
                       ("worker_preempted_per_1k_requests", "preempted per 1000 requests")):
        for threads in (c.get(key) or {}).values():
            if isinstance(threads, dict) and threads:
                parts.append(f"{label}: " + " ".join(f"{k} {v:.1f}" for k, v in threads.items()))
    return [f"{'':>16} cpu: " + ", ".join(parts)] if parts else []


def main(argv: list[str]) -> int:
    if not argv:
        sys.stderr.write(__doc__ or "")
        return 2
    folder = Path(argv[0])
    paths = [folder / f"{n}.json" for n in argv[1:]] or sorted(folder.glob("*.json"))
    print(HEADER)
    for path in paths:
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            print(f"{path.stem:>16} no result: {exc}")
            continue
        for line in lines(path.stem, doc):
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
