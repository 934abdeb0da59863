"""The photo bench's ratios, targets and table, from its measurements (pure functions of the JSON document).

Per photo size: ``b_over_a`` is (b) images/s over (a)'s, the median of the interleaved rounds' ratios
(bench/paired.py); ``b_over_c`` is (b) over (c); ``cpu_a_over_b`` (information) is (a)'s CPU per photo over (b)'s,
the worker's and the clients' together: what (b)/(a) is on a machine whose cores they saturate, and far less
moved by other load than the photos/s are; ``client_cpu_us_per_image_c_client`` (information, where (b') ran) is
the client CPU per photo of examples/c's client under the same load. The issue's targets: on a CPU worker,
(b) >= 0.9 x (a); on a GPU worker also (b) >= 3 x (c) and at most 30 us of client CPU per image in (b).
"""

from __future__ import annotations

from typing import Any

from shmbroker.bench.common import Figures
from shmbroker.bench.gpu_load import WORKER_STAGES

# name -> (comparison, target, GPU only, what it says)
TARGETS: dict[str, tuple[str, float, bool, str]] = {
    "b_over_a": (">=", 0.9, False, "(b) photos/s through the broker over (a) the in-process decode + preprocess + "
                 "engine at its best shape and batch, in windows taking turns"),
    "b_over_c": (">=", 3.0, True, "(b) photos/s with the worker decoding over (c) the clients decoding with Pillow"),
    "client_cpu_us_per_image_b": ("<=", 30.0, True, "client CPU microseconds per photo in (b)"),
}


def _per_s(f: Any) -> float | None:
    if isinstance(f, dict) and "error" not in f and isinstance(f.get("per_s"), int | float):
        return float(f["per_s"])
    return None


def ratios(size: Figures) -> Figures:
    """One size's ratios: b_over_a (paired rounds' median where (b) was paired with (a), else the plain
    quotient), b_over_c, and (b)'s client CPU per image."""
    a, b, c = (size.get(k) for k in ("inprocess", "broker", "pillow"))
    out: Figures = {"b_over_a": None, "b_over_c": None, "client_cpu_us_per_image_b": None, "cpu_a_over_b": None}
    cc = size.get("cclients")
    if isinstance(cc, dict) and isinstance(cc.get("client_cpu_us_per_image"), int | float):
        out["client_cpu_us_per_image_c_client"] = float(cc["client_cpu_us_per_image"])
    bv, av, cv = _per_s(b), _per_s(a), _per_s(c)
    if bv is not None and isinstance(b, dict):
        paired = b.get("paired", {})
        median = paired.get("per_s", {}).get("median") if paired.get("against") == "inprocess" else None
        if isinstance(median, int | float):
            out["b_over_a"] = float(median)
        elif av:
            out["b_over_a"] = round(bv / av, 3)
        if cv:
            out["b_over_c"] = round(bv / cv, 3)
        cpu = b.get("client_cpu_us_per_image")
        out["client_cpu_us_per_image_b"] = float(cpu) if isinstance(cpu, int | float) else None
        worker = b.get("worker_cpu_us_per_image")
        a_cpu = a.get("cpu_us_per_image") if isinstance(a, dict) else None
        if all(isinstance(v, int | float) and v > 0 for v in (cpu, worker, a_cpu)):
            out["cpu_a_over_b"] = round(float(a_cpu) / (float(worker) + float(cpu)), 3)  # type: ignore[arg-type]
    return out


def targets(size_ratios: Figures, gpu: bool) -> Figures:
    """Each target that applies to the worker's device: value, target, op, pass (False where not measured)."""
    out: Figures = {}
    for name, (op, target, gpu_only, what) in TARGETS.items():
        if gpu_only and not gpu:
            continue
        value = size_ratios.get(name)
        ok = isinstance(value, int | float) and (value >= target if op == ">=" else value <= target)
        out[name] = {"value": value, "target": target, "op": op, "pass": ok, "what": what}
    return out


def _num(value: Any, fmt: str = "{:,.1f}") -> str:
    return fmt.format(value) if isinstance(value, int | float) else "-"


ROWS = (("inprocess", "(a) in-process decode+engine"), ("broker", "(b) broker, encoded photos"),
        ("cclients", "(b') broker, the C client"), ("pillow", "(c) broker, Pillow in the clients"))


def _row(label: str, f: Any) -> str:
    if not isinstance(f, dict):
        return f"  {label:<36} not measured"
    if "error" in f:
        return f"  {label:<36} FAILED: {str(f['error']).splitlines()[0][:80]}"
    lat = f.get("latency", {})
    client = f.get("client_cpu_us_per_image")
    worker = f.get("worker_cpu_us_per_image", f.get("cpu_us_per_image"))
    notes = [f"decoder {f['decoder']}"] if f.get("decoder") else []
    if f.get("shape"):
        notes.append(f"{f['shape']}, batch {f['batch']}, decode {_num(f.get('decode_ms_per_image'), '{:.2f}')} ms + "
                     f"engine {_num(f.get('engine_ms_per_image'), '{:.2f}')} ms a photo")
    if f.get("mean_batch") is not None:
        notes.append(f"mean batch {f['mean_batch']}")
    if f.get("gpu_busy_pct") is not None:
        notes.append(f"GPU busy {f['gpu_busy_pct']:.0f} %")
    stages = f.get("stages") or {}
    ms = {k: stages[k]["mean_us"] / 1e3 for k in WORKER_STAGES if stages.get(k, {}).get("mean_us") is not None}
    if ms:
        notes.append("ms " + " / ".join(f"{k} {_num(ms.get(k), '{:.2f}')}" for k in WORKER_STAGES))
    by_thread = {k: v for k, v in (f.get("client_cpu_us_by_thread") or {}).items() if k != "total"}
    if by_thread:
        notes.append("client us " + " / ".join(f"{k} {v:,.0f}" for k, v in list(by_thread.items())[:3]))
    windows = f.get("windows", [])
    if len(windows) > 1:
        notes.append("windows " + " / ".join(_num(w.get("per_s"), "{:,.1f}") for w in windows))
    return (f"  {label:<36} {_num(f.get('per_s')):>9} {_num(_ms(lat, 'p50_us'), '{:.1f}'):>8}"
            f" {_num(_ms(lat, 'p99_us'), '{:.1f}'):>8} {_num(client, '{:,.0f}'):>10}"
            f" {_num(worker, '{:,.0f}'):>10}  {'; '.join(notes)}")


def _ms(latency: Figures, key: str) -> float | None:
    us = latency.get(key)
    return us / 1e3 if isinstance(us, int | float) else None


def table(doc: Figures) -> str:
    """The human summary: per size, (a) (b) (c) with their figures, then the ratios against the targets."""
    mach = doc["machine"]
    lines = [f"shmbroker bench --photos  {doc['date']}  {mach['cpu_model']}, {mach['cpu_count']} CPUs"
             + (f", {mach['gpu']}" if mach.get("gpu") else "") + f"; decoder {doc.get('decoder', '-')}",
             f"{doc['settings']['processes']} client processes x {doc['settings']['in_flight']} in flight"
             + (f" ({doc['settings']['photos_per_request']} photos a request in (b))"
                if doc["settings"].get("photos_per_request", 1) > 1 else "") + "; "
             f"{doc['settings']['duration_s']:g} s windows, {doc['settings']['rounds']} rounds of (a)/(b)", ""]
    head = f"  {'':<36} {'photos/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'client us':>10} {'worker us':>10}  notes"
    gpu = bool(mach.get("gpu"))
    for name, size in doc["measurements"].items():
        ps = doc.get("photoset", {}).get(name, {})
        lines += [f"{name} JPEG, {ps.get('images', '?')} photos, mean {_num(ps.get('mean_bytes'), '{:,.0f}')} bytes",
                  head]
        lines += [_row(label, size.get(key)) for key, label in ROWS if key != "cclients" or key in size]
        for tname, t in doc.get("targets", {}).get(name, {}).items():
            verdict = "n/a" if t["value"] is None else ("PASS" if t["pass"] else "FAIL")
            lines.append(f"  {tname:<36} {_num(t['value'], '{:.3f}'):>9} {t['op']} {t['target']:g}  {verdict}")
        r = doc.get("ratios", {}).get(name, {})
        if not gpu and r.get("b_over_c") is not None:
            lines.append(f"  {'b_over_c':<36} {_num(r['b_over_c'], '{:.3f}'):>9} (info on a CPU worker)")
        if r.get("client_cpu_us_per_image_c_client") is not None:
            lines.append(f"  {'client_cpu_us_per_image_c_client':<36} "
                         f"{_num(r['client_cpu_us_per_image_c_client'], '{:.3f}'):>9} (info: (b') with C clients)")
        if r.get("cpu_a_over_b") is not None:
            lines.append(f"  {'cpu_a_over_b':<36} {_num(r['cpu_a_over_b'], '{:.3f}'):>9} (info: (a)'s CPU per photo "
                         "over (b)'s, worker and clients)")
        lines.append("")
    lines.append(f"total {doc['elapsed_s']:.1f} s" + (f"; failures: {len(doc['failures'])}" if doc["failures"] else ""))
    return "\n".join(lines) + "\n"
