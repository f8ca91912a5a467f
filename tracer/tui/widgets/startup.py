"""Startup: the engine's stages with their timings, then the line to paste to send a request.

The stages come from the trace (engine BEGIN/END spans), so a replay shows the recorded run's
startup too. A stage in progress shows a bar; model weights and the KV cache show their sizes.
With tensor parallelism the weights and the KV cache get a line per rank under the engine's
(its worker's own time, and its shard: heads, MLP columns, vocabulary rows, bytes).
"""
from __future__ import annotations

import json

from rich.table import Table
from rich.text import Text
from textual.containers import VerticalScroll
from textual.widgets import ProgressBar, Static

from tracer.defaults import sample_body
from tracer.tui.fmt import fmt_bytes, hybrid_text, shard_details, speculation, stage_label
from tracer.tui.frame import Frame
from tracer.tui.widgets.panel import Panel


def stage_details(stage: dict) -> str:
    name = stage["stage"]
    if name == "model_load" and "params" in stage:
        draft = f" · draft model {stage['draft_params']:,} parameters" if "draft_params" in stage else ""
        threads = "".join(f" · {stage[k]}" for k in ("threads", "scheduling") if stage.get(k))
        return f"{stage['params']:,} parameters, {fmt_bytes(stage.get('bytes'))}{draft}{threads}"
    if name == "kv_cache_alloc" and "num_blocks" in stage:
        per_block = fmt_bytes(stage.get("bytes_per_block"))
        text = (f"{stage['num_blocks']} blocks × {stage['block_size']} tokens × {per_block}"
                f" = {fmt_bytes(stage.get('bytes'))}")
        if stage.get("kv_cache_groups"):  # a hybrid model: sliding-window groups recycle their blocks
            text += "; " + hybrid_text(stage)
        if stage.get("draft_bytes"):  # speculative decoding with a draft model: the same budget, fewer blocks
            text += (f", + {fmt_bytes(stage['draft_bytes'])} for the draft model's cache: each block also holds "
                     "the draft's keys and values, so the same memory holds fewer blocks")
        return text
    if name == "tokenizer_load" and "vocab_size" in stage:
        return f"vocab {stage['vocab_size']}"
    if name == "resolve_model":  # the architecture is named where it is not the default GPT-2
        arch = stage.get("architecture")
        return str(stage.get("model", "")) + (f" · {arch}" if arch and arch != "GPT2LMHeadModel" else "")
    return ""


RANK_STAGES = ("model_load", "kv_cache_alloc")  # the stages every worker does for itself


def rank_rows(workers: list[dict], stage: str) -> list[tuple]:
    """One row per rank for a stage: done (✓/✗ with its time and shard), in progress (…), or not yet."""
    rows = []
    for w in workers:
        label = f"  rank {w['rank']}"
        if stage in w:
            info, ok = w[stage], w[stage].get("ok", True)
            rows.append((Text("✓" if ok else "✗", "green" if ok else "red"), label,
                         f"{info.get('seconds', 0) * 1000:.1f} ms", shard_details(stage, info)))
        elif w.get("current") == stage:
            rows.append((Text("…", "yellow"), label, "", Text("in progress", "yellow")))
    return rows


def curl_line(url: str, model: str) -> str:
    body = json.dumps(sample_body(model))
    return f"curl {url}/v1/completions -H 'Content-Type: application/json' -d '{body}'"


class StartupPanel(Panel):
    def __init__(self, model: str, url: str | None, mode: str, **kwargs):
        super().__init__(**kwargs)
        self.model, self.url, self.mode = model, url, mode
        self._key = None

    def compose(self):
        with VerticalScroll(id="startup-scroll"):
            yield Static(id="startup-stages")
            yield ProgressBar(id="startup-progress", show_eta=False)
            yield Static(id="startup-ready")

    def focus_list(self) -> None:
        self.query_one("#startup-scroll").focus()

    def show(self, frame: Frame, force: bool = False) -> None:
        s = frame.state
        cur = s.startup_current
        ranks = tuple((w.get("current"), *(st in w for st in RANK_STAGES)) for w in s.workers)
        key = (len(s.startup), cur and (cur["stage"], cur.get("progress")), s.step is not None, ranks)
        if key == self._key and not force:
            return  # nothing new: startup panels are static once the server is up
        self._key = key
        table = Table.grid(padding=(0, 2))
        table.add_column(width=2)
        table.add_column(min_width=14)
        table.add_column(justify="right", min_width=9)
        table.add_column()
        for st in s.startup:
            ok = st.get("ok", True)
            table.add_row(Text("✓" if ok else "✗", "green" if ok else "red"), stage_label(st["stage"]),
                          f"{st.get('seconds', 0) * 1000:.1f} ms", stage_details(st))
            if st["stage"] in RANK_STAGES and s.workers:
                for row in rank_rows(s.workers, st["stage"]):
                    table.add_row(*row)
        done, total = (cur or {}).get("progress") or (0, None)
        if cur is not None:
            what = f"in progress: {fmt_bytes(done)} of {fmt_bytes(total)}" if total else "in progress"
            table.add_row(Text("…", "yellow"), stage_label(cur["stage"]), "", Text(what, "yellow"))
            if cur["stage"] in RANK_STAGES and s.workers:
                for row in rank_rows(s.workers, cur["stage"]):
                    table.add_row(*row)
        spec = speculation(s.engine_config)
        if spec:  # (vLLM logs its speculative config at startup too)
            table.add_row(Text("·", "cyan"), "speculation", "", Text(spec, "cyan"))
        self.query_one("#startup-stages", Static).update(table)
        bar = self.query_one("#startup-progress", ProgressBar)
        # The weights report bytes read; other stages only begin and end (an indeterminate bar).
        bar.display = cur is not None
        bar.update(total=total if cur is not None else 1, progress=done if cur is not None else 1)
        self.query_one("#startup-ready", Static).update(self._ready(s))

    def _ready(self, s) -> Text:
        up = s.step is not None or any(st["stage"] == "http_ready" for st in s.startup)
        if self.mode == "live" and not up or not s.startup and s.step is None:
            return Text("starting: the server answers once every stage above is done…", "dim")
        if self.mode == "replay":
            return Text.assemble(("Recorded run. ", "bold"), "←/→ step back and forward, home/end jump, "
                                 "1-7 or tab for the panels, ? for help.")
        if self.url:
            return Text.assemble(("Ready. ", "bold green"), f"{self.model} at {self.url}\n\n",
                                 ("Send a request from another terminal (greedy, as `vllm-trace send`):\n", "dim"),
                                 (curl_line(self.url, self.model), "bold"), "\n\n",
                                 ("or press ctrl+p and choose 'Send a test request' (16 tokens, greedy). "
                                  "The TUI then opens the Overview (1); Requests (2), KV cache (3), "
                                  "Step (4), Kernels (5), Log (6), this panel (7).", "dim"))
        return Text("Ready.", "bold green")
