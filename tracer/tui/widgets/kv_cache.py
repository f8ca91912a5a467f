"""KV cache: every physical block as a cell, coloured by the request that owns it.

    █ owned by one request    ▓ shared (a prefix-cache hit: several block tables point at it)
    ░ free, but its contents are still cached (a new request with that prefix can reuse it)
    · free

The whole cache always fits on the screen: when there are more blocks than cells (the CPU
default of thousands of blocks), each cell stands for k blocks (the summary says k) and shows
█ all k in use, ▒ some in use, ░ none in use but some cached, · all free. The selected
request's blocks stay in colour while everyone else's fade.

With tensor parallelism each rank's worker holds its own shard: the KV of its attention heads
for every block. The block ids (and the block tables) are the same on every rank, so one
grid stands for all of them; the summary adds a line per rank with its heads and bytes.

A hybrid model (sliding-window and full-attention layers: Mistral, Gemma 3) has a block table per
KV-cache group in one pool: every group's blocks are drawn, and the summary names the groups and how
many requests of max_model_len fit at once against full attention on every layer.

With a host-memory tier behind the cache (--kv-offloading-size: the OffloadingConnector) the summary
adds its size in blocks, the blocks it holds, and since the start the blocks stored there, the prompt
tokens found there and the blocks loaded back (the engine's kv_connector_stats).

With grouped-query attention (Llama, Qwen3) the summary says how many query heads share each
KV head and what a block costs: only KV heads are cached, so a block is smaller by that factor.
"""
from __future__ import annotations

import time

from rich.segment import Segment
from rich.style import Style
from rich.text import Text

from tracer.state import hybrid_cache, kv_shards
from tracer.tui.fmt import fmt_bytes, hybrid_text, sparkline
from tracer.tui.frame import Frame
from tracer.tui.widgets.kv_transfer import offload_line
from tracer.tui.widgets.lines import FixedText, LinesView
from tracer.tui.widgets.panel import Panel

LABEL = 6  # "12345 " block id at the start of each row
GRID_HZ = 4  # grid redraws per second at most (the gauge and the counts follow every refresh)


def block_owners(frame: Frame) -> dict[int, list[str]]:
    s = frame.state
    owners: dict[int, list[str]] = {}
    for rid, r in s.requests.items():
        if r.block_table and not r.status.startswith("FINISHED"):
            for table in [r.block_table, *r.kv_block_tables[1:]]:  # a hybrid model: every group's blocks
                for b in table:
                    if b:  # (0: the null block, where a sliding window has passed)
                        owners.setdefault(b, []).append(rid)
    return owners


def blocks_per_cell(num_blocks: int, width: int, rows: int) -> int:
    per_row = max(8, (width - LABEL) // 2)
    return max(1, -(-num_blocks // (per_row * max(1, rows))))


def draw_blocks(frame: Frame, num_blocks: int, width: int, rows_available: int) -> list[list[Segment]]:
    """The grid as segments, one list per row; runs of cells that look alike share a segment."""
    owners = block_owners(frame)
    per_row = max(8, (width - LABEL) // 2)
    k = blocks_per_cell(num_blocks, width, rows_available)
    sel, cached = frame.selected, frame.state.cached_free
    rows = []
    for start in range(0, num_blocks, per_row * k):
        cells = []
        for first in range(start, min(start + per_row * k, num_blocks), k):
            group = range(first, min(first + k, num_blocks))
            who = [owners[b] for b in group if b in owners]
            if who:
                mine = sel is None or any(sel in w for w in who)
                color = frame.color(sel) if sel is not None and mine else frame.color(who[0][0])
                shared = any(len(w) > 1 for w in who)
                char = "▓ " if shared else "█ " if len(who) == len(group) else "▒ "
                cells.append((char, _style(color if mine else f"{color} dim")))
            elif any(b in cached for b in group):
                cells.append(("░ ", _style("dim")))
            else:
                cells.append(("· ", _style("#444444")))
        row = [Segment(f"{start:>{LABEL - 1}} ", _style("dim"))]
        for text, style in cells:  # merge runs: a full cache is a few segments per row, not hundreds
            if row[-1].style is style:
                row[-1] = Segment(row[-1].text + text, style)
            else:
                row.append(Segment(text, style))
        rows.append(row)
    return rows


_styles: dict[str, Style] = {}


def gqa_line(startup: list[dict]) -> str:
    """'' for multi-head attention; else the query heads per KV head and the bytes of a block."""
    kv = next((st for st in reversed(startup) if st["stage"] == "kv_cache_alloc" and "num_kv_heads" in st), None)
    if kv is None or kv["num_kv_heads"] >= kv["num_heads"]:
        return ""
    h, h_kv, g = kv["num_heads"], kv["num_kv_heads"], kv["num_heads"] // kv["num_kv_heads"]
    return (f"\nGQA: {h} query heads share {h_kv} KV heads ({g} each); the cache holds KV heads only: "
            f"{fmt_bytes(kv['bytes_per_block'])} a block = 2 × {kv['num_layers']} layers × {kv['block_size']} tokens × "
            f"{h_kv} KV heads × {kv['head_size']} dims, 1/{g} of one KV head per query head")


def shard_lines(shards: list[dict]) -> str:
    """One line saying the block table is shared, then each rank's heads and bytes ('' for one rank)."""
    if len(shards) < 2:
        return ""
    n_head = max((sh.get("heads") or [0, 0])[1] for sh in shards)
    lines = [f"\n{len(shards)} ranks, one shard each: the same blocks and block tables on every rank, "
             "each holding its own heads' K and V"]
    for sh in shards:
        a, b = sh.get("heads") or ("?", "?")
        kv = sh.get("kv_heads")
        kv = f" (KV heads [{kv[0]}, {kv[1]}))" if kv and kv != sh.get("heads") else ""
        lines.append(f"rank {sh['rank']}: heads [{a}, {b}) of {n_head}{kv} · {fmt_bytes(sh.get('bytes'))} "
                     f"({fmt_bytes(sh.get('bytes_per_block'))} a block)")
    return "\n".join(lines)


def _style(spec: str) -> Style:
    style = _styles.get(spec)
    if style is None:
        style = _styles[spec] = Style.parse(spec)
    return style


class KVCachePanel(Panel):
    def compose(self):
        yield FixedText(id="kv-summary")
        yield LinesView(id="kv-grid")

    def on_mount(self) -> None:
        self._key = None
        self._drawn_at = 0.0
        self._drawn_key = None

    def show(self, frame: Frame, force: bool = False) -> None:
        s = frame.state
        total = s.stats.get("num_total_blocks") or s.num_blocks or 0
        free = s.stats.get("num_free_blocks", total)
        used = total - free
        width = self.size.width or 80
        key = (s.last_seq, frame.selected, width, self.size.height)
        if key == self._key and not force:
            return
        self._key = key
        owners = block_owners(frame)
        shared = sum(1 for w in owners.values() if len(w) > 1)
        usage = used / total if total else 0.0
        bar_w = max(10, min(40, width - 56))
        filled = round(usage * bar_w)
        hybrid = hybrid_cache(s)
        shards = gqa_line(s.startup) + shard_lines(kv_shards(s)) + (
            "\nhybrid: " + hybrid_text(hybrid) + "; sliding-window blocks go back to the pool as the window passes"
            if hybrid else "") + offload_line(s)
        grid_rows = max(4, (self.size.height or 20) - 5 - shards.count("\n"))
        k = blocks_per_cell(total, width, grid_rows) if total else 1
        legend = ("\n█ owned  ▓ shared prefix  ░ cached, free  · free" if k == 1 else
                  f"\neach cell = {k} blocks: █ all in use  ▒ some  ▓ shared  ░ cached, free  · free")
        summary = Text.assemble(
            ("KV cache ", "bold"), ("█" * filled, "green" if usage < 0.8 else "red"),
            ("░" * (bar_w - filled), "dim"),
            f" {usage:5.1%} {used}/{total} used · {shared} shared · {len(s.cached_free)} cached",
            ("\nper step ", "dim"), (sparkline(s.kv_usage_history, max(10, width - 12), top=1.0), "green"),
            (legend, "dim"),
            ("   (select a request to highlight its blocks)" if frame.selected is None
             else f"   highlighted: request {frame.selected}", "dim"),
            (shards, "cyan"))
        head = self.query_one("#kv-summary", FixedText)
        height = 3 + shards.count("\n")  # the CSS's 3 lines, and the ranks' under them
        if head.styles.height is None or head.styles.height.value != height:
            head.styles.height = height
        head.update(summary)
        grid = self.query_one("#kv-grid", LinesView)
        now = time.monotonic()
        if not total:
            grid.update(Text("no KV cache yet (the engine is starting)", "dim"))
        elif (force or now - self._drawn_at >= 1 / GRID_HZ or frame.controller.get("paused")
              or key[1:] != self._drawn_key):
            self._drawn_at, self._drawn_key = now, key[1:]
            grid.update_rows(draw_blocks(frame, total, width, grid_rows))
        else:
            self._key = None  # not drawn yet: look again next refresh
