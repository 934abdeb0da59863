"""The GPU bench's targets and its human table (figures: bench/RESULTS.md#gpu-path)."""

from __future__ import annotations

from typing import Any

from shmbroker.bench.common import Figures
from shmbroker.gpu_worker.pipeline import STAGES

LONE_SLACK_MS = 0.3  # what a lone request through the broker may add to the engine's batch-1 time in-process


def _get(m: dict[str, Figures], *path: str) -> float | None:
    cur: Any = m
    for p in path:
        if not isinstance(cur, dict):
            return None
        cur = cur.get(p)
    return float(cur) if isinstance(cur, int | float) else None


def _target(value: float | None, op: str, target: float, what: str) -> Figures:
    ok = value is not None and (value >= target if op == ">=" else value <= target)
    return {"value": None if value is None else round(value, 3), "op": op, "target": target, "pass": ok, "what": what}


def targets(m: dict[str, Figures], classic: Figures | None = None) -> dict[str, Figures]:
    """One engine's targets from its (a) ``limit`` and (c) ``broker`` figures and the run's (b) ``classic``."""
    c, a, b = _get(m, "broker", "per_s"), _get(m, "limit", "items_per_s"), _get({"classic": classic or {}},
                                                                               "classic", "per_s")
    a2 = _get(m, "limit", "concurrent_streams", "items_per_s")
    a3 = _get(m, "limit", "with_copies", "items_per_s")
    max_ms, delay_ms = _get(m, "limit", "max_batch_ms"), _get(m, "broker", "max_queue_delay_ms")
    p99_ms = _get(m, "broker", "latency", "p99_us")
    bound = None if max_ms is None or delay_ms is None else 4 * max_ms + delay_ms
    batch1_ms, lone_c = _get(m, "limit", "by_batch", "1", "ms_per_batch"), _get(m, "broker", "latency", "p50_us")
    lone = _get(m, "broker", "clients") == 1 and _get(m, "broker", "in_flight_per_client") == 1
    lone_bound = None if batch1_ms is None else batch1_ms + LONE_SLACK_MS
    lone_copies = _get(m, "limit", "lone", "p50_ms")
    return {
        "c_over_a": _target(None if c is None or not a else c / a, ">=", 0.9,
                            "(c) shmbroker images/s over (a) the engine's in-process limit at its best batch size"),
        "c_over_b": _target(None if c is None or not b else c / b, ">=", 10.0,
                            "(c) shmbroker images/s over (b) the classic synchronous server"),
        "gpu_busy_pct_c": _target(_get(m, "broker", "gpu_busy_pct"), ">=", 90.0,
                                  "GPU utilization during (c), NVML samples inside the window"),
        "c_over_a_streams_info": {**_target(None if c is None or not a2 else c / a2, ">=", 0.0,
                                            "information: (c) over (a') the engine on `streams` streams at once"),
                                  "pass": None},
        "c_over_a_copies_info": {**_target(None if c is None or not a3 else c / a3, ">=", 0.0,
                                           "information: (c) over (a'') the worker's stream slots with their "
                                           "copies, no broker"),
                                 "pass": None},
        "p99_ms_c": {**_target(None if p99_ms is None else p99_ms / 1e3, "<=", round(bound, 3) if bound else 0.0,
                               "p99 latency of (c) in ms, against 4 x one max batch's compute + max_queue_delay"),
                     "bound_ms": None if bound is None else round(bound, 3)},
        "p50_ms_lone": {**_target(lone_c / 1e3 if lone and lone_c is not None else None, "<=",
                                  round(lone_bound, 3) if lone_bound else 0.0,
                                  "with 1 process x 1 in flight: p50 of (c) in ms, against (a)'s batch-1 time + "
                                  f"{LONE_SLACK_MS} ms"),
                        "bound_ms": None if lone_bound is None else round(lone_bound, 3),
                        "lone_copies_ms": lone_copies},  # information: (a)'s one request at a time, copies included
    }


def summary(key: str, f: Figures) -> str:
    if key == "copies":
        return f"{len(f) - 4} comparisons"
    if key == "limit":
        return (f"{f['items_per_s']:,.0f} images/s at batch {f['best_batch']}; max batch {f['max_batch_ms']:.3f} ms; "
                f"engine loaded in {f.get('load_s')} s")
    lat = f.get("latency", {})
    return (f"{f['per_s']:,.1f} images/s, p50 {lat.get('p50_us', 0) / 1e3:.2f} ms, "
            f"p99 {lat.get('p99_us', 0) / 1e3:.2f} ms, GPU busy {f.get('gpu_busy_pct')} %")


def _n(v: Any, fmt: str = "{:,.1f}") -> str:
    return fmt.format(v) if isinstance(v, int | float) else "-"


def _limit_lines(engine: str, lim: Figures) -> list[str]:
    if not lim or "error" in lim:
        return [f"{'(a) ' + engine:<48} FAILED {str(lim.get('error', 'not run')).splitlines()[0][:60]}"]
    per = ", ".join(f"b{b} {v['items_per_s']:,.0f}" for b, v in lim["by_batch"].items())
    head = f"(a) {engine}: in-process, CUDA graphs, one stream"
    lines = [f"{head:<48} {_n(lim['items_per_s']):>10} {'':>8} {'':>8} {'':>6}  "
             f"best batch {lim['best_batch']}; max batch {lim['max_batch_ms']:.3f} ms; load {lim.get('load_s')} s",
             f"{'':<48} {'':>10} {'':>8} {'':>8} {'':>6}  {per}"]
    cc = lim.get("concurrent_streams", {})
    label = f"(a') {engine}: {cc.get('streams', '?')} streams at once (info)"
    how = cc.get("error", f"batch {cc.get('batch')} on each stream, wall-clock timed")
    lines.append(f"{label:<48} {_n(cc.get('items_per_s')):>10} {'':>8} {'':>8} {'':>6}  {how}")
    wc = lim.get("with_copies", {})
    label = f"(a'') {engine}: {wc.get('streams', '?')} slots, copies (info)"
    how = wc.get("error", f"batch {wc.get('batch')}; a batch's H2D {_n(wc.get('h2d_ms'), '{:.3f}')} ms, "
                          f"compute {_n(wc.get('compute_ms'), '{:.3f}')} ms, D2H {_n(wc.get('d2h_ms'), '{:.3f}')} ms")
    lines.append(f"{label:<48} {_n(wc.get('items_per_s')):>10} {'':>8} {'':>8} {'':>6}  {how}")
    return lines


def _load_line(label: str, f: Figures, limit: float | None = None) -> str:
    if not f or "error" in f:
        return f"{label:<48} FAILED {str(f.get('error', 'not run')).splitlines()[0][:60]}"
    lat = f["latency"]
    note = f"errors {f['errors']}"
    if limit:
        note += f"; (c)/(a) {f['per_s'] / limit:.3f}"
    st = f.get("stages", {})
    if st.get("mean_batch") is not None:
        note += f"; mean batch {st['mean_batch']}; event-timed compute busy {st.get('compute_busy_pct')} %"
    return (f"{label:<48} {_n(f['per_s']):>10} {_n(lat.get('p50_us', 0) / 1e3, '{:.2f}'):>8} "
            f"{_n(lat.get('p99_us', 0) / 1e3, '{:.2f}'):>8} {_n(f.get('gpu_busy_pct'), '{:.0f}'):>6}  {note}")


def _stage_lines(engine: str, st: Figures) -> list[str]:
    lines = ["", f"{'stage in (c) ' + engine + ', worker':<26} {'mean us':>9} {'p50 us':>9} {'p99 us':>9} {'count':>9}"]
    for stage in STAGES:
        s = st.get(stage, {})
        lines.append(f"{stage:<26} {_n(s.get('mean_us')):>9} {_n(s.get('p50_us')):>9} {_n(s.get('p99_us')):>9} "
                     f"{_n(s.get('count'), '{:,}'):>9}")
    return lines


def table(doc: Figures) -> str:
    m: dict[str, Figures] = doc["measurements"]
    mach = doc["machine"]
    lines = [f"shmbroker GPU bench  {doc['date']}  {mach.get('gpu')}, {mach['cpu_model']}, {mach['cpu_count']} CPUs, "
             f"Python {mach['python']}  ({doc['settings']['duration_s']:g} s windows)", "",
             f"{'measurement':<48} {'images/s':>10} {'p50 ms':>8} {'p99 ms':>8} {'GPU %':>6}  notes", "-" * 110]
    n = doc["settings"]["processes"]
    if m.get("classic"):
        lines.append(_load_line(f"(b) classic sync server, {n} clients", m["classic"]))
    for engine, f in m.get("engines", {}).items():
        lim = f.get("limit", {})
        lines += _limit_lines(engine, lim)
        if "broker" in f:
            best = lim.get("items_per_s") if isinstance(lim, dict) else None
            api = f["broker"].get("api", "call") if isinstance(f["broker"], dict) else "call"
            lines.append(_load_line(f"(c) {engine}: shmbroker, {n} procs batch-1, {api}", f["broker"], best))
    for engine, f in m.get("engines", {}).items():
        st = f.get("broker", {}).get("stages", {})
        if st:
            lines += _stage_lines(engine, st)
    cp = m.get("copies", {})
    rows = [k for k in cp if k.startswith(("h2d_x", "d2h_x"))]
    if rows:
        lines += ["", f"{'copies (registered ring)':<26} {'per call: host us':>18} {'device us':>10} "
                      f"{'batched: host us':>17} {'device us':>10}"]
        for k in rows:
            pc, bt = cp[k].get("per_call", {}), cp[k].get("batched", {})
            lines.append(f"{k:<26} {_n(pc.get('host_us')):>18} {_n(pc.get('device_us')):>10} "
                         f"{_n(bt.get('host_us')):>17} {_n(bt.get('device_us')):>10}")
    lines += ["", f"{'target':<30} {'value':>10} {'target':>12}  result", "-" * 70]
    for engine, ts in doc["targets"].items():
        for name, t in ts.items():
            verdict = ("info" if t["pass"] is None else "PASS" if t["pass"]
                       else "n/a" if t["value"] is None else "FAIL")
            bound = f"{t['op']} {t['target']:g}"
            lines.append(f"{engine + ' ' + name:<30} {_n(t['value'], '{:.3f}'):>10} {bound:>12}  {verdict}")
    lines.append(f"total {doc['elapsed_s']:.1f} s" + (f"; failures: {doc['failures']}" if doc["failures"] else ""))
    return "\n".join(lines) + "\n"
