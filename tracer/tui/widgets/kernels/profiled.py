"""The profiled step (the Kernels panel's fourth mode): while profiling is on (`p`, or POST
/start_profile) every op of the forward pass is a launch with its kind, FLOPs and bytes. The
step is listed longest op first, with its share of the step, its arithmetic intensity, achieved
rate and the roof over it (memory- or compute-bound against this machine's measured roofline),
and a roofline chart replaces the program grid below the list.

tracer.roofline (and torch, under kernels.roofline) is imported once a profiled step is shown."""
from __future__ import annotations

from typing import TYPE_CHECKING

from rich.text import Text

from tracer.tui.fmt import fmt_bytes, fmt_ns
from tracer.tui.frame import Frame
from tracer.tui.widgets.kernels.launches import held_launch
from tracer.tui.widgets.rows import cells_text

if TYPE_CHECKING:
    from kernels.roofline import Roofline

PROFILED_SCOPE = "listed: every op of the forward pass, longest first (profiling: p turns it on and off)"
BAR = 8  # cells of the share-of-the-step bar


def share_bar(share: float) -> str:
    """'███▌     27%': an op's share of the step, in eighths of a cell."""
    eighths = round(max(0.0, min(1.0, share)) * BAR * 8)
    full, part = divmod(eighths, 8)
    return ("█" * full + (" ▏▎▍▌▋▊▉"[part] if part else "")).ljust(BAR) + f" {share:>4.0%}"


def bound_cell(point, roof: Roofline | None) -> tuple[str, str | None]:
    if roof is None or not point.flops or not point.bytes:
        return "-", "dim"
    bound = point.bound(roof)
    return bound, "red" if bound == "memory" else "green"


def kind_shares(ops, total_ns: int) -> str:
    """'matmul 52% · attention 9% · …': where the listed time goes, by op kind."""
    from tracer.roofline import by_kind

    sums = by_kind(ops)
    order = sorted(sums.items(), key=lambda kv: -kv[1].duration_ns)
    return " · ".join(f"{k} {p.duration_ns / total_ns:.0%}" for k, p in order) if total_ns else ""


def profiled_head(frame: Frame, ops, roof: Roofline | None, calibrating: bool, rank: int | None,
                  ranks: bool) -> Text:
    """The step's ops, their time against the step's, by kind, and this machine's roofs."""
    from tracer.roofline import fmt_count

    s = frame.state
    total = sum(o.duration_ns for o in ops)
    head = Text.assemble((f"step {'-' if s.step is None else s.step}: ", "bold"), (f"{len(ops)} ops profiled", "bold"),
                         (f" ({s.phase})" if s.phase not in ("done", "idle") else "", "dim"), f" · {fmt_ns(total)}")
    if s.phase == "done" and s.step_ns:
        head.append(f" = {total / s.step_ns:.0%} of the step's {fmt_ns(s.step_ns)} wall time")
    held = held_launch(frame)
    if held is not None:
        layer = held.get("layer_idx", "?")  # None: a launch of no layer (building the inputs, sampling)
        head.append(f"   held before {held.get('name', '?')}{'' if layer is None else f' (layer {layer})'}", "yellow")
    if ranks:
        head.append(f"   rank {'all' if rank is None else rank} of {s.tensor_parallel_size}", "bold")
        head.append("  (r: next rank)", "dim")
    head.append("\nby kind: " + kind_shares(ops, total))
    if roof is not None:
        head.append(f"\nroofs (this machine, {roof.dtype}): {fmt_count(roof.peak_flops, 'FLOP/s')} · "
                    f"{fmt_count(roof.peak_bw, 'B/s')} · ridge {roof.ridge:.3g} FLOP/byte", "cyan")
    else:
        head.append("\nroofs: " + ("calibrating this machine's roofline…" if calibrating else
                                    "no roofline for this device on this machine (vllm-trace roofline)"), "dim")
    head.append("\n" + PROFILED_SCOPE, "dim")
    return head


def profiled_table(ops, roof: Roofline | None, ranks: bool, width: int) -> tuple[tuple, list[tuple[str, tuple]]]:
    """(header, rows): one row per op, longest first; optional columns go on a narrow terminal."""
    from tracer.roofline import fmt_count

    total = sum(o.duration_ns for o in ops)
    columns = [("#", 3), *([("rank", 4)] if ranks else []), ("layer", 5),
               ("op", max([2] + [len(o.name) for o in ops])), ("kind", 11), ("share", BAR + 5), ("time", 9),
               ("FLOPs", 9), ("bytes", 9), ("FLOP/B", 7), ("achieved", 12), ("bound", 7)]
    for optional in ("kind", "bytes", "achieved", "FLOPs"):  # a narrow terminal: the table still fits
        if sum(w + 2 for _, w in columns) + 1 <= width:
            break
        columns = [c for c in columns if c[0] != optional]
    names, widths = [n for n, _ in columns], [w for _, w in columns]
    rows = []
    for i, o in enumerate(ops):
        p = o.point
        cells = {"#": str(i), "rank": str(o.rank), "layer": "" if o.layer is None else str(o.layer),
                 "op": o.name, "kind": o.kind, "share": share_bar(o.duration_ns / total if total else 0.0),
                 "time": fmt_ns(o.duration_ns), "FLOPs": fmt_count(p.flops) if p.flops else "-",
                 "bytes": fmt_bytes(p.bytes) if p.bytes else "-",
                 "FLOP/B": f"{p.intensity:.3g}" if p.flops and p.bytes else "-",
                 "achieved": fmt_count(p.flops_per_s, "FLOP/s") if p.flops else fmt_count(p.bytes_per_s, "B/s"),
                 "bound": bound_cell(p, roof)}
        rows.append((str(i), cells_text([cells[n] for n in names], widths)))
    return cells_text(names, widths), rows
