"""Small formatting helpers shared by the panels (times, sizes, colours, text sparklines)."""
from __future__ import annotations

from rich.text import Text

# Request colours: distinct on dark and light themes, cycled by arrival order (stable: a
# request keeps its colour for its whole life and in every panel).
PALETTE = ["#e06c75", "#98c379", "#61afef", "#e5c07b", "#c678dd", "#56b6c2", "#d19a66", "#be5046",
           "#7ec699", "#f0a6ca", "#a0a8ff", "#ffd866"]
SPARK = "▁▂▃▄▅▆▇█"


# The startup stages in words, by their trace names: serve's lines and the Startup panel say the
# same (a learner who reads "weights" in one and model_load in the other sees two things).
STAGE_LABELS = {"args": "arguments", "config": "config", "core_process_start": "engine core process",
                "resolve_model": "model files", "tokenizer_load": "tokenizer",
                "resolve_draft_model": "draft model files", "model_load": "weights",
                "kv_cache_alloc": "KV cache", "kernel_warmup": "kernel warm-up", "core_handshake": "engine core ready",
                "http_ready": "HTTP ready"}
STAGE_WIDTH = max(map(len, STAGE_LABELS.values()))


def stage_label(name: str) -> str:
    return STAGE_LABELS.get(name, name)


def color_map(request_ids) -> dict[str, str]:
    """Each request's colour, by arrival order (the state's requests dict keeps that order)."""
    return {rid: PALETTE[i % len(PALETTE)] for i, rid in enumerate(request_ids)}


def fmt_ns(ns: int | float | None) -> str:
    if ns is None:
        return "-"
    if ns < 1_000:
        return f"{ns:.0f} ns"
    if ns < 1_000_000:
        return f"{ns / 1e3:.1f} µs"
    if ns < 1_000_000_000:
        return f"{ns / 1e6:.1f} ms"
    return f"{ns / 1e9:.2f} s"


def fmt_age(ns: int | None) -> str:
    if ns is None or ns < 0:
        return "-"
    s = ns / 1e9
    if s < 1:
        return f"{ns / 1e6:.0f}ms"
    if s < 10:
        return f"{s:.1f}s"
    if s < 60:
        return f"{s:.0f}s"
    return f"{int(s // 60)}m{int(s % 60):02d}s"


def plural(n: int, word: str) -> str:
    """'1 request', '2 requests', '3 launches'."""
    return f"{n} {word}{'' if n == 1 else 'es' if word.endswith('ch') else 's'}"


def fmt_age_coarse(ns: int | None) -> str:
    """Whole seconds: a list of many requests then changes once a second, not every refresh."""
    if ns is None or ns < 0:
        return "-"
    s = int(ns // 1_000_000_000)
    return "<1s" if s < 1 else f"{s}s" if s < 60 else f"{s // 60}m{s % 60:02d}s"


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def sparkline(values, width: int = 16, top: float | None = None) -> str:
    """The last `width` values as block characters, scaled to `top` (default: their maximum)."""
    values = list(values)[-width:]
    if not values:
        return ""
    top = top or max(values) or 1
    return "".join(SPARK[min(len(SPARK) - 1, int(v / top * (len(SPARK) - 1) + 0.5))] for v in values)


STATUS_STYLES = {"WAITING": "yellow", "WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR": "yellow",  # (its grammar compiling)
                 "RUNNING": "green", "PREEMPTED": "bold red", "FINISHED_ABORTED": "red"}


def status_text(status: str) -> Text:
    style = STATUS_STYLES.get(status, "dim")
    if status.startswith("FINISHED"):
        return Text("aborted" if status == "FINISHED_ABORTED" else "finished", style=style)
    label = status.lower()
    return Text(label, style=style)


def speculation(engine_config: dict | None, short: bool = False) -> str:
    """How the engine speculates ('' when it does not): 'speculative decoding: draft model
    tiny-gpt2-draft, up to 3 draft tokens a step', or short, 'spec tiny-gpt2-draft ×3'."""
    spec = (engine_config or {}).get("speculative")
    if not spec:
        return ""
    k = spec.get("num_speculative_tokens")
    if short:
        return f"spec {spec.get('model') or spec.get('method')} ×{k}"
    how = (f"draft model {spec.get('model')}" if spec.get("method") == "draft_model" else
           f"n-gram prompt lookup ({spec.get('prompt_lookup_min')}-{spec.get('prompt_lookup_max')} tokens)")
    return f"speculative decoding: {how}, up to {k} draft tokens a step"


def prompt_progress(r) -> str:
    """'computed/total' of a request's prompt tokens, as every panel counts them (Overview, Requests)."""
    return f"{min(r.num_computed_tokens, r.num_prompt_tokens)}/{r.num_prompt_tokens}"


def output_progress(r) -> str:
    """'generated/max_tokens' (or the count alone when no maximum is known)."""
    return f"{r.num_output_tokens}/{r.max_tokens}" if r.max_tokens else str(r.num_output_tokens)


def shorten(s: str, n: int) -> str:
    return s if len(s) <= n else s[:n - 1] + "…"


def fmt_span(r) -> str:
    """[start, end) of a rank's heads, columns or rows."""
    return f"[{r[0]}, {r[1]})" if r else "-"


def shard_details(stage: str, info: dict) -> str:
    """A tensor-parallel rank's shard, as its worker reported it at the end of a startup stage
    (model_load or kv_cache_alloc): the Startup panel's and `serve`'s per-rank lines."""
    if stage == "model_load":
        return (f"{info.get('params', 0):,} parameters, {fmt_bytes(info.get('bytes'))} · heads "
                f"{fmt_span(info.get('heads'))} · mlp cols {fmt_span(info.get('mlp'))} · vocab "
                f"{fmt_span(info.get('vocab'))}" + (f" · {info['threads']}" if info.get("threads") else ""))
    return (f"{info.get('num_blocks')} blocks × {fmt_bytes(info.get('bytes_per_block'))} = "
            f"{fmt_bytes(info.get('bytes'))} · heads {fmt_span(info.get('heads'))}")


def hybrid_text(h: dict) -> str:
    """A hybrid model's groups, and the requests of max_model_len tokens that fit, against full attention."""
    groups = ", ".join((f"sliding window {g['sliding_window']}" if g.get("sliding_window") else "full attention")
                       + f" (layers {' '.join(map(str, g.get('layers') or []))})" for g in h["kv_cache_groups"])
    return (f"{len(h['kv_cache_groups'])} KV-cache groups: {groups}; {h['requests_at_max_len']} requests of "
            f"max_model_len fit at once ({h['blocks_per_request']} blocks each), "
            f"{h['requests_at_max_len_full_attention']} with full attention on every layer")


def hybrid_fit(h: dict) -> str:
    """The header's word on a hybrid KV cache: how many more requests of max_model_len fit than with full
    attention on every layer ('' for one KV-cache group)."""
    if not h:
        return ""
    more = h["requests_at_max_len"] - h["requests_at_max_len_full_attention"]
    return f"hybrid KV: {h['requests_at_max_len']} requests fit, {more} more than with full attention"

