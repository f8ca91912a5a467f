"""Routing: a mixture of experts' choices in the latest step, from its routing events.

A layer × expert heat map of the tokens each expert received (a cell's shade is its share of the
layer's busiest expert), and per layer the busiest expert, the idle ones and the imbalance (the
busiest expert's tokens ÷ the mean: 1.0 is a perfect balance; the step lasts as long as its
busiest expert takes). Under expert parallelism, the tokens each rank's experts computed
(allgather_reducescatter: every rank receives every token, computes its own experts' share, and
the reduce-scatter sums the shares). Below, for the selected request (else the first in the
step), each of its tokens' experts, best first, with their routing weights, per layer.
The Step panel shows it only while the model routes (its engine emits routing events).
"""
from __future__ import annotations

from rich.console import Group
from rich.text import Text

from tracer.tui.fmt import plural
from tracer.tui.frame import Frame
from tracer.tui.widgets.lines import LinesView
from tracer.tui.widgets.panel import Panel

SHADES = ("#1e2a38", "#234e70", "#2a6f97", "#468faf", "#89c2d9", "#e9f5db")  # 0 tokens, then darkest to busiest
MAX_TOKENS = 6  # of the selected request's tokens, shown one line each


def shade(count: int, busiest: int) -> str:
    if count <= 0 or busiest <= 0:
        return SHADES[0]
    return SHADES[1 + min(len(SHADES) - 2, (len(SHADES) - 2) * count // busiest)]


def layer_summary(counts: list[int]) -> str:
    busiest = max(counts, default=0)
    idle = [e for e, n in enumerate(counts) if n == 0]
    mean = sum(counts) / len(counts) if counts else 0
    idle_text = f"idle {' '.join(map(str, idle[:8]))}{' …' if len(idle) > 8 else ''}" if idle else "none idle"
    imbalance = f"imbalance {busiest / mean:.1f}×" if mean else "no tokens"
    return f"busiest {counts.index(busiest) if busiest else '-'} ({busiest}) · {idle_text} · {imbalance}"


def heat_map(routing: dict, width: int) -> list[Text]:
    """One line per layer: a cell per expert (its count, on its shade), then the layer's summary."""
    layers = [routing[k] for k in sorted(routing, key=lambda k: (k is None, k))]
    num_experts = max(len(a.get("expert_counts") or ()) for a in layers)
    busiest = max(max(a.get("expert_counts") or [0]) for a in layers)
    cell = max(2, len(str(busiest)) + 1)
    if 8 + num_experts * cell > width:  # too many experts for numbers: a shaded column each
        cell = 1
    head = Text("expert  ", style="bold dim")
    for e in range(num_experts):
        head.append(f"{e:>{cell}}" if cell > 1 else ("|" if e % 10 == 0 else " "), "dim")
    lines = [head]
    for a in layers:
        counts = list(a.get("expert_counts") or ())
        line = Text(f"L{a.get('layer_idx')!s:<6}", style="bold")
        for n in counts:
            line.append(f"{n if n else '·':>{cell}}" if cell > 1 else " ", f"black on {shade(n, busiest)}")
        line.append("  " + layer_summary(counts), "dim")
        lines.append(line)
    return lines


def ranks_line(routing: dict) -> Text | None:
    """Expert parallelism: the tokens each rank's experts computed in the first routed layer."""
    first = routing[min(routing, key=lambda k: (k is None, k))]
    ranks = first.get("rank_counts") or []
    if len(ranks) < 2:
        return None
    per_rank = len(first.get("expert_counts") or ()) // len(ranks)
    parts = [f"rank {r} (experts {r * per_rank}-{(r + 1) * per_rank - 1}): {plural(n, 'token')}"
             for r, n in enumerate(ranks)]
    return Text("expert parallel, layer " + str(first.get("layer_idx")) + ": " + " · ".join(parts), "cyan")


def request_lines(frame: Frame, routing: dict) -> list[Text]:
    """Each of one request's tokens this step: per layer its experts, best first, with their weights."""
    first = routing[min(routing, key=lambda k: (k is None, k))]
    ids = first.get("topk_ids") or {}
    rid = frame.selected if frame.selected in ids else next(iter(ids), None)
    if rid is None:
        return []
    n = len(ids[rid])
    lines = [Text.assemble(("experts of request ", "bold"), (rid, f"bold {frame.color(rid)}"),
                           (f"  ({plural(n, 'token')} this step; expert·weight, best first)", "dim"))]
    layers = sorted(routing, key=lambda k: (k is None, k))
    for t in range(min(n, MAX_TOKENS)):
        line = Text(f"  token {t:<3}", "dim")
        for k in layers:
            experts = (routing[k].get("topk_ids") or {}).get(rid) or []
            weights = (routing[k].get("topk_weights") or {}).get(rid) or []
            if t < len(experts):
                pairs = " ".join(f"{e}·{w:.2f}" for e, w in zip(experts[t], weights[t] if t < len(weights) else []))
                line.append(f"  L{k} ", "bold")
                line.append(pairs)
        lines.append(line)
    if n > MAX_TOKENS:
        lines.append(Text(f"  … {n - MAX_TOKENS} more tokens", "dim"))
    return lines


def routing_view(frame: Frame, width: int) -> Group:
    s = frame.state
    routing = s.routing
    first = routing[min(routing, key=lambda k: (k is None, k))]
    counts = first.get("expert_counts") or ()
    tokens = sum(counts) // max(1, first.get("top_k") or 1)
    head = Text.assemble((f"mixture of experts: routing in step {s.routing_step}", "bold"),
                         (f"   {plural(len(counts), 'expert')}, top-{first.get('top_k')}; "
                          f"{plural(tokens, 'token')} routed in each of {plural(len(routing), 'layer')}", "dim"))
    parts = [head, *heat_map(routing, width)]
    ranks = ranks_line(routing)
    if ranks is not None:
        parts.append(ranks)
    return Group(*parts, *request_lines(frame, routing))


class RoutingView(Panel):
    """The routing, shown above the Step panel's columns while the model is a mixture of experts."""

    def compose(self):
        yield LinesView(id="routing-lines")

    def show(self, frame: Frame, force: bool = False) -> None:
        self.display = bool(frame.state.routing)
        if self.display:  # just shown, it has no size yet: the screen's width until the next layout
            width = self.size.width or self.app.size.width
            self.query_one("#routing-lines", LinesView).update(routing_view(frame, max(20, width - 2)))
