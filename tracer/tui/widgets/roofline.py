"""The roofline chart: a profiled step's ops, one point per op kind, under this machine's two roofs.

Log-log, as rooflines are drawn: arithmetic intensity (FLOP per byte moved) across, achieved
FLOP/s up. The sloped roof is the memory bandwidth (FLOP/s = intensity × bytes/s), the flat one
the peak FLOP/s; they meet at the ridge point. A point under the slope is memory-bound: only more
bandwidth (or fewer bytes: a bigger batch reuses each weight it reads) moves it up. Each point is
drawn as its kind's letter (M matmul, A attention, N norm, ...), named in the legend. Drawn with
textual-plotext; the same geometry (tracer/roofline.py) draws ``vllm-trace export --roofline``.
tracer.roofline (torch, under kernels.roofline) is imported once a chart is drawn, not with the TUI.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from textual_plotext import PlotextPlot

if TYPE_CHECKING:
    from kernels.roofline import OpPoint, Roofline

MARKERS = {"matmul": "M", "attention": "A", "cache_write": "C", "norm": "N", "elementwise": "E",
           "embedding": "B", "sampler": "S", "collective": "R"}
COLORS = ["red", "green", "orange", "magenta", "blue", "yellow", "white", "gray"]


def marker(kind: str, upper: bool = True) -> str:
    m = MARKERS.get(kind, kind[:1] or "?")
    return m.upper() if upper else m.lower()


def decade_ticks(lo: float, hi: float, unit: str) -> tuple[list[float], list[str]]:
    ticks = [10.0 ** e for e in range(round(math.log10(lo)), round(math.log10(hi)) + 1)]
    from tracer.roofline import fmt_count

    return ticks, [fmt_count(t, unit) for t in ticks]


def plot_roofline(plt, series: list[tuple[str, dict[str, OpPoint]]], roof: Roofline | None, title: str = "",
                  legend: bool = True) -> None:
    """Draw on a plotext figure: the roofs, then each series' op kinds as letters (the first
    series in capitals, the next in small letters), named in the legend when ``legend``."""
    from tracer.roofline import chart_range, fmt_count, plotted, roof_points

    series = [(label, plotted(points)) for label, points in series]
    every = {f"{label}:{k}": p for label, points in series for k, p in points.items()}
    plt.clear_data()
    plt.clear_figure()
    plt.title(title)
    plt.xscale("log")
    plt.yscale("log")
    x0, x1, y0, y1 = chart_range(every, roof)
    plt.xlim(math.log10(x0), math.log10(x1))  # (plotext takes a log axis's limits as exponents)
    plt.ylim(math.log10(y0), math.log10(y1))
    plt.xticks(*decade_ticks(x0, x1, ""))
    plt.yticks(*decade_ticks(y0, y1, "FLOP/s"))
    plt.xlabel("arithmetic intensity (FLOP/byte)")
    if roof is not None:
        xy = roof_points(roof, x0, x1)
        plt.plot([x for x, _ in xy], [y for _, y in xy], marker="braille", color="cyan",
                 label=f"roofs: {fmt_count(roof.peak_bw, 'B/s')} · {fmt_count(roof.peak_flops, 'FLOP/s')}"
                 if legend else None)
        plt.text(f"◆ ridge {roof.ridge:.3g} FLOP/B", roof.ridge, roof.peak_flops, color="cyan", alignment="left")
    for s_i, (label, points) in enumerate(series):
        for i, (kind, p) in enumerate(points.items()):
            bound = f" ({p.bound(roof)})" if roof is not None else ""
            name = f"{label} {kind}" if label else kind
            plt.scatter([p.intensity], [p.flops_per_s], marker=marker(kind, s_i == 0), color=COLORS[i % len(COLORS)],
                        label=f"{name}{bound}" if legend else None)


class RooflineChart(PlotextPlot):
    """``set_points(points, roof)`` draws one point per op kind (named, with its bound, in the
    legend) and the roofs, when this machine has been calibrated; it redraws only when what it
    shows changed."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._drawn: tuple | None = None

    def set_points(self, points: dict[str, OpPoint], roof: Roofline | None, title: str = "") -> None:
        from tracer.roofline import plotted

        key = (tuple(plotted(points).items()), roof, title)
        if key == self._drawn:
            return
        self._drawn = key
        self.refresh()

    def render(self):
        # Drawn afresh for every render: plotext's build scales a log axis's data in place, so a
        # figure built twice (a resize, a layout pass) would take the log of a log.
        if self._drawn is not None:
            points, roof, title = self._drawn
            plot_roofline(self.plt, [("", dict(points))], roof, title)
        return super().render()
