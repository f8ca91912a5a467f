"""`vllm-trace export TRACE --roofline OUT.html`: a recorded trace's profiled steps on the roofline, for a projector.

The Kernels panel's chart drawn large, as a self-contained page (an inline SVG: no script, no
fonts or files fetched, so it opens offline and prints) or the bare SVG. By default it places
the last profiled prefill step and the last profiled decode step on the same axes, one point per
op kind each (filled: prefill, hollow: decode), under the two roofs of this machine's calibration
(``vllm-trace roofline``) for the trace's device; a trace recorded on a device this machine lacks
is drawn without roofs, and says so. A table under the chart lists each step's op kinds.
"""
from __future__ import annotations

import html
import math
from dataclasses import dataclass
from pathlib import Path

from kernels.roofline import OpPoint, Roofline
from tracer.roofline import by_kind, chart_range, fmt_count, plotted, profiled_ops

W, H = 960, 600
LEFT, RIGHT, TOP, BOTTOM = 90, 220, 50, 60  # margins: the y labels, the legend, the title, the x labels
COLORS = {"matmul": "#e06c75", "attention": "#61afef", "cache_write": "#56b6c2", "norm": "#e5c07b",
          "elementwise": "#c678dd", "embedding": "#98c379", "sampler": "#d19a66", "collective": "#abb2bf"}


@dataclass
class ChartStep:
    """One profiled step as drawn: its label ("prefill", "decode"), step number and ops."""

    label: str
    step: int
    launches: list[dict]
    num_tokens: int | None = None
    num_requests: int | None = None

    @property
    def points(self) -> dict[str, OpPoint]:
        return by_kind(profiled_ops(self.launches))


def _esc(s) -> str:
    return html.escape(str(s), quote=True)


def svg(steps: list[ChartStep], roof: Roofline | None, title: str) -> str:
    """The roofline chart as an SVG document (a string)."""
    every = {f"{s.label}:{k}": p for s in steps for k, p in plotted(s.points).items()}
    x0, x1, y0, y1 = chart_range(every, roof)
    lx0, lx1, ly0, ly1 = map(math.log10, (x0, x1, y0, y1))
    pw, ph = W - LEFT - RIGHT, H - TOP - BOTTOM

    def px(x: float) -> float:
        return LEFT + (math.log10(x) - lx0) / (lx1 - lx0) * pw

    def py(y: float) -> float:
        return TOP + ph - (math.log10(y) - ly0) / (ly1 - ly0) * ph

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {W} {H}" width="{W}" height="{H}" '
           f'font-family="sans-serif" font-size="13">',
           f'<rect width="{W}" height="{H}" fill="white"/>',
           f'<text x="{W / 2 - RIGHT / 2}" y="28" text-anchor="middle" font-size="17" font-weight="bold">'
           f'{_esc(title)}</text>']
    for e in range(round(lx0), round(lx1) + 1):  # a grid line per decade
        x = px(10.0 ** e)
        out.append(f'<line x1="{x:.1f}" y1="{TOP}" x2="{x:.1f}" y2="{TOP + ph}" stroke="#ddd"/>')
        out.append(f'<text x="{x:.1f}" y="{TOP + ph + 20}" text-anchor="middle">{_esc(fmt_count(10.0 ** e))}</text>')
    for e in range(round(ly0), round(ly1) + 1):
        y = py(10.0 ** e)
        out.append(f'<line x1="{LEFT}" y1="{y:.1f}" x2="{LEFT + pw}" y2="{y:.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{LEFT - 8}" y="{y + 4:.1f}" text-anchor="end">{_esc(fmt_count(10.0 ** e, "FLOP/s"))}'
                   '</text>')
    out.append(f'<rect x="{LEFT}" y="{TOP}" width="{pw}" height="{ph}" fill="none" stroke="#333"/>')
    out.append(f'<text x="{LEFT + pw / 2}" y="{H - 18}" text-anchor="middle">arithmetic intensity (FLOP per byte '
               'moved), log scale</text>')
    out.append(f'<text transform="translate(18 {TOP + ph / 2}) rotate(-90)" text-anchor="middle">achieved FLOP/s, '
               'log scale</text>')
    if roof is not None:  # the roof: the bandwidth's slope up to the ridge point, then the peak
        xs = [x0] + ([roof.ridge] if x0 < roof.ridge < x1 else []) + [x1]
        path = " ".join(f"{'M' if i == 0 else 'L'}{px(x):.1f},{py(max(y0, roof.attainable(x))):.1f}"
                        for i, x in enumerate(xs))
        out.append(f'<path d="{path}" fill="none" stroke="#2c7fb8" stroke-width="3"/>')
        if x0 < roof.ridge < x1:
            rx = px(roof.ridge)
            out.append(f'<line x1="{rx:.1f}" y1="{py(roof.peak_flops):.1f}" x2="{rx:.1f}" y2="{TOP + ph}" '
                       'stroke="#2c7fb8" stroke-dasharray="4 4"/>')
            out.append(f'<text x="{rx + 6:.1f}" y="{TOP + ph - 8}" fill="#2c7fb8">ridge {roof.ridge:.3g} FLOP/byte'
                       '</text>')
        out.append(f'<text x="{LEFT + 8}" y="{py(roof.peak_flops) - 8:.1f}" fill="#2c7fb8">peak '
                   f'{_esc(fmt_count(roof.peak_flops, "FLOP/s"))} ({_esc(roof.dtype)} matmul)</text>')
        slope_x = x0 * 10 ** ((math.log10(roof.ridge) - lx0) / 3) if roof.ridge > x0 else x0
        out.append(f'<text x="{px(slope_x) + 8:.1f}" y="{py(roof.attainable(slope_x)) - 8:.1f}" fill="#2c7fb8">'
                   f'memory {_esc(fmt_count(roof.peak_bw, "B/s"))}</text>')
    for s_i, s in enumerate(steps):
        for kind, p in plotted(s.points).items():
            color = COLORS.get(kind, "#333")
            fill = color if s_i == 0 else "white"
            x, y = px(p.intensity), py(p.flops_per_s)
            bound = f", {p.bound(roof)}-bound" if roof is not None else ""
            out.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="7" fill="{fill}" stroke="{color}" stroke-width="3">'
                       f'<title>{_esc(s.label)} {_esc(kind)}: {p.intensity:.3g} FLOP/byte, '
                       f'{_esc(fmt_count(p.flops_per_s, "FLOP/s"))}{bound}</title></circle>')
            out.append(f'<text x="{x + 10:.1f}" y="{y + 4:.1f}" fill="{color}">{_esc(kind)}</text>')
    ly = TOP + 10  # the legend: a line per step, then a line per kind
    for s_i, s in enumerate(steps):
        fill = "#555" if s_i == 0 else "white"
        out.append(f'<circle cx="{W - RIGHT + 30}" cy="{ly}" r="6" fill="{fill}" stroke="#555" stroke-width="3"/>')
        out.append(f'<text x="{W - RIGHT + 44}" y="{ly + 4}">{_esc(s.label)} (step {s.step})</text>')
        ly += 22
    for kind in dict.fromkeys(k for s in steps for k in plotted(s.points)):
        color = COLORS.get(kind, "#333")
        out.append(f'<rect x="{W - RIGHT + 24}" y="{ly - 6}" width="12" height="12" fill="{color}"/>')
        out.append(f'<text x="{W - RIGHT + 44}" y="{ly + 4}">{_esc(kind)}</text>')
        ly += 20
    if roof is None:
        out.append(f'<text x="{W - RIGHT + 24}" y="{ly + 10}" fill="#b00">no roofline for this</text>'
                   f'<text x="{W - RIGHT + 24}" y="{ly + 26}" fill="#b00">device on this machine</text>')
    out.append("</svg>")
    return "\n".join(out)


def page(steps: list[ChartStep], roof: Roofline | None, title: str, source: str) -> str:
    """A self-contained HTML page: the chart, the roofs and a table of each step's op kinds."""
    rows = []
    for s in steps:
        total = sum(p.duration_ns for p in s.points.values()) or 1
        for kind, p in sorted(s.points.items(), key=lambda kv: -kv[1].duration_ns):
            bound = p.bound(roof) if roof is not None and p.flops and p.bytes else "-"
            rows.append(f"<tr><td>{_esc(s.label)} (step {s.step})</td><td>{_esc(kind)}</td>"
                        f"<td>{p.duration_ns / total:.0%}</td><td>{p.duration_ns / 1e3:.1f} µs</td>"
                        f"<td>{_esc(fmt_count(p.flops))}</td><td>{_esc(fmt_count(p.bytes, 'B'))}</td>"
                        f"<td>{p.intensity:.3g}</td><td>{_esc(fmt_count(p.flops_per_s, 'FLOP/s'))}</td>"
                        f"<td>{bound}</td></tr>" if p.bytes else
                        f"<tr><td>{_esc(s.label)} (step {s.step})</td><td>{_esc(kind)}</td>"
                        f"<td>{p.duration_ns / total:.0%}</td><td>{p.duration_ns / 1e3:.1f} µs</td>"
                        "<td>-</td><td>-</td><td>-</td><td>-</td><td>-</td></tr>")
    roofs = ("<p>Roofs measured on this machine (<code>vllm-trace roofline</code>): peak "
             f"{_esc(fmt_count(roof.peak_flops, 'FLOP/s'))} ({_esc(roof.dtype)} matmul), bandwidth "
             f"{_esc(fmt_count(roof.peak_bw, 'B/s'))}, ridge point {roof.ridge:.3g} FLOP/byte: an op below it is "
             "memory-bound, above it compute-bound.</p>" if roof is not None else
             "<p>No roofline for the trace's device on this machine: the points are drawn without roofs.</p>")
    return (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{_esc(title)}</title>"
            "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
            "td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}"
            "td:first-child,td:nth-child(2){text-align:left}</style></head><body>\n"
            f"{svg(steps, roof, title)}\n{roofs}\n<p>From <code>{_esc(source)}</code>.</p>\n"
            "<table><tr><th>step</th><th>op kind</th><th>share</th><th>time</th><th>FLOPs</th><th>bytes</th>"
            "<th>FLOP/byte</th><th>achieved</th><th>bound</th></tr>\n" + "\n".join(rows) + "\n</table>\n"
            "</body></html>\n")


def steps_of_trace(path: str | Path, step: int | None = None) -> tuple[list[ChartStep], str]:
    """(the steps to draw, the trace's device) from a recorded trace: the given step, or the last
    profiled prefill step and the last profiled decode step (a step is a decode step when every
    request in its batch has one query token)."""
    from engine.trace_names import BATCH, CONFIG, ENGINE, KERNEL, MODEL_RUNNER
    from tracer.events import TraceReader

    launches: dict[int, list[dict]] = {}
    shape: dict[int, tuple[int, int]] = {}
    device = "cpu"
    with TraceReader(path) as reader:
        for ev in reader:
            a = ev.attrs or {}
            if ev.layer == KERNEL and ev.step is not None and ev.kind != "begin" and a.get("profiled"):
                if (a.get("rank") or 0) == 0:
                    launches.setdefault(ev.step, []).append({"name": ev.name, **a})
            elif (ev.layer, ev.name) == (MODEL_RUNNER, BATCH) and ev.step is not None:
                shape[ev.step] = (len(a.get("input_ids") or ()), len(a.get("request_ids") or ()))
            elif (ev.layer, ev.name) == (ENGINE, CONFIG):
                device = ((a.get("config") or {}).get("model") or {}).get("device") or device
    if not launches:
        raise ValueError(f"{path} has no profiled steps: record with profiling on (POST /start_profile, "
                         "`p` in the TUI, LLM.start_profile()) and export again")
    if step is not None:
        if step not in launches:
            raise ValueError(f"step {step} of {path} was not profiled (profiled steps: {_ranges(sorted(launches))})")
        tokens, reqs = shape.get(step, (None, None))
        label = "step" if tokens is None else "prefill" if tokens > reqs else "decode"
        return [ChartStep(label, step, launches[step], tokens, reqs)], device
    prefill = [s for s in launches if s in shape and shape[s][0] > shape[s][1]]
    decode = [s for s in launches if s in shape and shape[s][0] == shape[s][1]]
    chosen = [("prefill", max(prefill))] if prefill else []
    chosen += [("decode", max(decode))] if decode else []
    if not chosen:
        last = max(launches)
        chosen = [("step", last)]
    return [ChartStep(label, s, launches[s], *shape.get(s, (None, None))) for label, s in chosen], device


def _ranges(steps: list[int]) -> str:
    return ", ".join(map(str, steps[:8])) + (" …" if len(steps) > 8 else "")


def export_roofline(trace: str | Path, out: str | Path, step: int | None = None,
                    roof: Roofline | None = None) -> tuple[list[ChartStep], Roofline | None]:
    """Write the chart of a recorded trace's profiled steps to ``out`` (.html or .svg)."""
    out = Path(out)
    if out.suffix.lower() not in (".html", ".htm", ".svg"):
        raise ValueError(f"--roofline writes an .html page or an .svg image, not {out.suffix or 'a file without a '}"
                         f"{'' if out.suffix else 'suffix'}: name it e.g. roofline.html")
    steps, device = steps_of_trace(trace, step)
    if roof is None:
        from tracer.roofline import machine_roofline, trace_dtype
        try:
            roof, _, _ = machine_roofline(device, trace_dtype(steps[0].launches))
        except Exception:  # a trace of a device this machine lacks: drawn without roofs
            roof = None
    title = "Where a step's time goes: " + " vs ".join(f"{s.label} (step {s.step})" for s in steps)
    text = svg(steps, roof, title) if out.suffix.lower() == ".svg" else page(steps, roof, title, str(trace))
    out.write_text(text, encoding="utf-8")
    return steps, roof
