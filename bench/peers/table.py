"""The "Peers on the GPU" table of bench/RESULTS.md from one or more peers documents (pure; no IO but ``main``).

One table per card: documents of the same device (a run split over calls on one machine) merge into one table,
in the order given. Below each table: the in-process limit of each run and the two acceptance comparisons, the
ring client against the best peer (throughput, and p50 at concurrency 1), with the winner of each column named.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

Doc = dict[str, Any]

RING = ("shmbroker", "ring")
THROUGHPUT_TARGET = 1.5  # the ring client's answers/s over the best peer's, at least
HEADER = ("| server | client | c=1 p50 ms | c=1 p99 ms | in flight | answers/s | p50 ms | p99 ms | GPU busy | "
          "host CPU us/answer (server + clients) | answers checked, wrong, max diff |")
RULE = "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"


def _ms(us: Any) -> str:
    return "n/a" if us is None else f"{us / 1e3:,.2f}"


def _num(v: Any, fmt: str = "{:,.0f}") -> str:
    return "n/a" if v is None else fmt.format(v)


def rows(doc: Doc, run: int = 1) -> list[Doc]:
    """One row per server and client protocol of a document (run ``run`` of its card), with the figures the
    table shows."""
    out: list[Doc] = []
    for server, s in doc.get("servers", {}).items():
        if "error" in s and not s.get("routes"):
            out.append({"server": server, "route": "-", "label": s.get("label", server), "client": "-",
                        "error": s["error"], "run": run})
            continue
        for route, r in s.get("routes", {}).items():
            row: Doc = {"server": server, "route": route, "label": s.get("label", server),
                        "client": r.get("client", route), "error": r.get("error"), "run": run}
            c1, best = r.get("c1") or {}, r.get("best") or {}
            row["c1_p50_us"] = (c1.get("latency") or {}).get("p50_us")
            row["c1_p99_us"] = (c1.get("latency") or {}).get("p99_us")
            row["in_flight"] = (f"{best['processes']} x {best['in_flight_per_process'][0]}"
                                if best.get("processes") else None)
            row["per_s"] = best.get("per_s")
            row["p50_us"] = (best.get("latency") or {}).get("p50_us")
            row["p99_us"] = (best.get("latency") or {}).get("p99_us")
            row["gpu_busy_pct"] = best.get("gpu_busy_pct")
            cpu = best.get("cpu_us_per_request") or {}
            row["cpu"] = cpu
            answers = [x.get("answers") for x in (c1, *r.get("saturation", [])) if x.get("answers")]
            row["checked"] = sum(a["checked"] for a in answers)
            row["wrong"] = sum(a["wrong"] for a in answers)
            row["max_abs_diff"] = max((a["max_abs_diff"] for a in answers), default=None)
            out.append(row)
    return out


def _key(row: Doc) -> str:
    return f"{row['run']}/{row['server']}/{row['route']}"


def _label(row: Doc, runs: int) -> str:
    return f"{row['label']} (run {row['run']})" if runs > 1 else str(row["label"])


def _line(row: Doc, bold: set[tuple[str, str]], runs: int = 1) -> str:
    label = _label(row, runs)
    if row.get("error") and row.get("per_s") is None:
        return f"| {label} | {row['client']} | failed: {str(row['error']).splitlines()[0][:120]} |" + " |" * 8

    def b(text: str, column: str) -> str:
        return f"**{text}**" if (column, _key(row)) in bold else text

    cpu = row["cpu"]
    host = ("n/a" if cpu.get("host") is None else
            f"{cpu['host']:,.0f} ({_num(cpu.get('server'))} + {_num(cpu.get('clients'))})")
    diff = "n/a" if row["max_abs_diff"] is None else f"{row['max_abs_diff']:.2g}"
    return (f"| {label} | {row['client']} | {b(_ms(row['c1_p50_us']), 'c1')} | {_ms(row['c1_p99_us'])} | "
            f"{row['in_flight'] or 'n/a'} | {b(_num(row['per_s']), 'per_s')} | {_ms(row['p50_us'])} | "
            f"{_ms(row['p99_us'])} | {_num(row['gpu_busy_pct'], '{:.0f} %')} | {host} | "
            f"{row['checked']:,}, {row['wrong']:,}, {diff} |")


def _ratio_line(ring: Doc, best: Doc, what: str) -> str:
    ratio = ring["per_s"] / best["per_s"] if best["per_s"] else float("inf")
    return (f"{what} over the best peer ({best['label']}, {best['client']}): **{ratio:.2f} x** answers/s "
            f"(target >= {THROUGHPUT_TARGET}: {'met' if ratio >= THROUGHPUT_TARGET else 'MISSED'}).")


def verdict(table_rows: Sequence[Doc]) -> tuple[list[str], set[tuple[str, str]]]:
    """The acceptance comparisons, and the cells to set in bold: each column's winner.

    Over several runs of one card (a run split over calls) the overall comparison is the cautious one: the
    slowest run's ring client against the best peer of any run, the ring client's highest c=1 p50 against the
    lowest peer's; each run's own ring-over-best-peer follows.
    """
    ok = [r for r in table_rows if r.get("per_s") is not None and not r.get("wrong")]
    ring = [r for r in ok if (r["server"], r["route"]) == RING]
    peers = [r for r in ok if r["server"] != RING[0]]
    runs = sorted({r["run"] for r in table_rows})
    notes: list[str] = []
    bold: set[tuple[str, str]] = set()
    if ok:
        bold.add(("per_s", _key(max(ok, key=lambda r: r["per_s"]))))
        with_c1 = [r for r in ok if r.get("c1_p50_us") is not None]
        if with_c1:
            bold.add(("c1", _key(min(with_c1, key=lambda r: r["c1_p50_us"]))))
    notes += [f"{_label(x, len(runs))} ({x['client']}): {x['wrong']} wrong answers; its figures do not count."
              for x in table_rows if x.get("wrong")]
    if not ring or not peers:
        notes.append("Acceptance: not judged (" + ("no ring-client row" if not ring else "no peer row") + ").")
        return notes, bold
    r = min(ring, key=lambda x: x["per_s"])
    best = max(peers, key=lambda x: x["per_s"])
    what = "Ring client" if len(ring) == 1 else f"Ring client (its slowest run, {r['run']})"
    notes.append(_ratio_line(r, best, what))
    if best["per_s"] > r["per_s"]:
        notes.append(f"A peer wins the throughput column: {_label(best, len(runs))} ({best['client']}).")
    c1_ring = [x for x in ring if x.get("c1_p50_us") is not None]
    c1_peers = [p for p in peers if p.get("c1_p50_us") is not None]
    if c1_ring and c1_peers:
        slowest = max(c1_ring, key=lambda x: x["c1_p50_us"])
        lowest = min(c1_peers, key=lambda x: x["c1_p50_us"])
        met = slowest["c1_p50_us"] <= lowest["c1_p50_us"]
        notes.append(f"Concurrency 1: ring client p50 {_ms(slowest['c1_p50_us'])} ms, lowest peer "
                     f"{_ms(lowest['c1_p50_us'])} ms ({_label(lowest, len(runs))}, {lowest['client']}): "
                     f"{'met' if met else 'MISSED'}{'' if met else '; a peer wins the c=1 p50 column'}.")
    if len(runs) > 1:
        for run in runs:
            rr = [x for x in ring if x["run"] == run]
            pp = [x for x in peers if x["run"] == run]
            if rr and pp:
                notes.append(_ratio_line(rr[0], max(pp, key=lambda x: x["per_s"]), f"Run {run}: its ring client"))
    return notes, bold


def limit_line(doc: Doc) -> str:
    inproc = doc.get("inprocess", {})
    parts = []
    device = inproc.get("device_limit") or {}
    if device.get("items_per_s") is not None:
        parts.append(f"in-process limit {device['items_per_s']:,.0f} images/s at batch {device['best_batch']} "
                     "(device only, no copies)")
    runner = inproc.get("runner_limit") or {}
    if runner.get("items_per_s") is not None:
        parts.append(f"{runner['items_per_s']:,.0f} images/s at batch {runner['best_batch']} through one engine "
                     "instance as the peers run it" + (", its copies included" if doc.get("device_name") else ""))
    return f"{doc.get('date', '?')} ({', '.join(doc.get('peers_run', []))}): " + ("; ".join(parts) or "no limit")


def card(doc: Doc) -> str:
    m = doc.get("machine", {})
    return str(doc.get("device_name") or f"CPU: {m.get('cpu_model', '?')} ({m.get('cpu_affinity', '?')} cores)")


def render(docs: Sequence[Doc]) -> str:
    """Markdown: one section per card, its runs' rows in order, then the limits and the verdict."""
    by_card: dict[str, list[Doc]] = {}
    for d in docs:
        by_card.setdefault(card(d), []).append(d)
    out: list[str] = []
    for name, group in by_card.items():
        table_rows = [r for k, d in enumerate(group, 1) for r in rows(d, k)]
        notes, bold = verdict(table_rows)
        s = group[0].get("settings", {})
        out += [f"#### {name}", "",
                f"Model {s.get('model', '?')} on engine {s.get('engine', '?')}, max batch "
                f"{s.get('max_batch', '?')}, delay {s.get('max_queue_delay_us', '?')} us; one-row requests; "
                f"windows of {s.get('duration_s', '?')} s; c=1: one process, one request in flight.", "",
                HEADER, RULE]
        out += [_line(r, bold, len(group)) for r in table_rows]
        out += ["", *(f"- {'' if len(group) == 1 else f'Run {k}, '}{limit_line(d)}" for k, d in enumerate(group, 1)),
                *(f"- {n}" for n in notes), ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m shmbroker.bench.peers.table",
                                 description="the Peers table (markdown) of peers JSON documents")
    ap.add_argument("docs", nargs="+", help="JSON documents of bench.peers.run, in the order of their rows")
    args = ap.parse_args(argv)
    docs = []
    for path in args.docs:
        try:
            docs.append(json.loads(Path(path).read_text()))
        except (OSError, json.JSONDecodeError) as exc:
            print(f"cannot read {path}: {exc}", file=sys.stderr)
            return 2
    sys.stdout.write(render(docs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
