"""The picture of ``shmbroker bench --plot FILE.png``: throughput against p50/p99 latency, one panel per model.

matplotlib is an optional extra (``pip install shmbroker[plot]``), imported only here and only when a
picture is asked for. The figure is drawn through the Agg canvas directly (no pyplot), so it never needs
a display and changes no global backend of a process that imported matplotlib for something else.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shmbroker.bench.common import BenchError, Figures

HINT = "--plot needs matplotlib: pip install 'shmbroker[plot]'"
PANEL_IN = (5.2, 4.0)  # inches per model panel; with DPI a ~60 kB PNG for two panels
DPI = 100


def require() -> None:
    """Raise BenchError naming the ``plot`` extra when matplotlib cannot be imported (checked before the run)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise BenchError(f"{HINT} ({exc})") from None


def _panel(ax: Any, sweep: Figures) -> None:
    from matplotlib import ticker

    pts = sweep["points"]
    x = [p["per_s"] for p in pts]
    for key, style, name in (("p50_us", "o-", "p50"), ("p99_us", "s--", "p99")):
        y = [p["latency"][key] / 1e3 for p in pts]
        ax.plot(x, y, style, label=name, markersize=4)
        for p, xi, yi in zip(pts, x, y, strict=True):
            ax.annotate(str(p["concurrency"]), (xi, yi), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_yscale("log")
    # 1-2-5 steps in plain numbers: the default log labels (6x10^0) are hard to read across a decade or two
    ax.yaxis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _pos: f"{v:g}"))
    ax.yaxis.set_minor_formatter(ticker.NullFormatter())
    unit = "images" if sweep["model"] == "nsfw" else "requests"
    ax.set_xlabel(f"throughput ({unit}/s)")
    ax.set_ylabel("latency per request (ms, log)")
    ax.set_title(f"{sweep['model']}: points labelled with the requests in flight", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="best")


def draw(sweeps: list[Figures], path: Path, title: str) -> None:
    """Write a PNG of one panel per sweep (``bench.sweep.sweep`` results) to ``path``, parents created.

    Raises BenchError when matplotlib is missing or there is nothing to draw.
    """
    require()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if not sweeps:
        raise BenchError("--plot: no sweep has figures to draw")
    fig = Figure(figsize=(PANEL_IN[0] * len(sweeps), PANEL_IN[1]), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(sweeps), squeeze=False)[0]
    for ax, sweep in zip(axes, sweeps, strict=True):
        _panel(ax, sweep)
    fig.suptitle(title, fontsize=9)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=DPI)


def write(doc: Figures, path: Path) -> None:
    """Draw the sweeps of a bench document (``measurements.<model>_sweep`` without an error) to ``path``."""
    sweeps = [f for k, f in doc["measurements"].items()
              if k.endswith("_sweep") and isinstance(f, dict) and "error" not in f]
    mach = doc["machine"]
    draw(sweeps, path, f"shmbroker bench sweep, {doc['date']}, {mach['cpu_model']}, {mach['cpu_count']} CPUs")
