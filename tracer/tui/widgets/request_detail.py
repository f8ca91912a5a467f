"""One request, in full: its prompt as tokens, the text it has generated so far, its journey
through the engine, where its KV cache lives (the block table), and the KV a connector moved for it
(widgets/kv_transfer.py)."""
from __future__ import annotations

import time

from rich.console import Group
from rich.text import Text

from tracer.state import RequestView, hybrid_cache, kv_connector, prompt_sources
from tracer.tui.fmt import fmt_age, status_text
from tracer.tui.frame import Frame
from tracer.tui.widgets.kv_transfer import kv_transfer_section
from tracer.tui.widgets.lines import LinesView

MAX_TOKENS_SHOWN = 256  # prompt tokens drawn one by one; the rest are counted


def block_size(frame: Frame) -> int | None:
    return ((frame.state.engine_config or {}).get("cache") or {}).get("block_size")


def waiting_why(frame: Frame, r) -> str:
    """Why a request is not running (or how it finished), in full."""
    s = frame.state
    if r.status == "PREEMPTED" or (r.status == "WAITING" and r.num_preemptions):
        return f"preempted: {r.preempt_reason or '?'}"
    if r.status == "WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR":
        return r.waiting_reason or "its grammar is compiling"
    if r.status == "WAITING":
        if r.waiting_reason:
            return r.waiting_reason
        if frame.controller.get("paused") or frame.controller.get("pause_requested"):
            return "not scheduled yet: the engine is held"
        return "not scheduled yet" if s.step is None or s.phase == "done" else ""
    if r.status.startswith("FINISHED"):
        return r.finish_reason or ""
    return ""


def worker_slot(r: RequestView) -> str:
    """ · worker slot N: where the worker keeps the request (its row in the persistent batch) since it
    first ran; a finished request's slot is free again."""
    if r.worker_slot is None:
        return ""
    done = r.status.startswith("FINISHED") or r.status == "ABORTED"
    return f" · worker slot {r.worker_slot}" + (" (freed)" if done else "")


def token_pieces(ids: list[int], pieces: list[str]) -> Text:
    """'Hello' as  H·72 e·101 ...: every piece, a dot, its id, on alternating backgrounds so
    token boundaries are visible (a piece may be part of a word, a lone space, or a digit: the
    dot keeps piece "1" with id 49 from reading as 149)."""
    t = Text()
    for i, (tid, piece) in enumerate(zip(ids[:MAX_TOKENS_SHOWN], pieces)):
        shown = piece.replace("\n", "↵").replace(" ", "␣") or "∅"
        t.append(shown, "on #303848" if i % 2 else "on #3a3046")
        t.append(f"·{tid}", "dim")
        t.append(" ")
    if len(ids) > MAX_TOKENS_SHOWN:
        t.append(f"… +{len(ids) - MAX_TOKENS_SHOWN} tokens", "dim")
    elif len(pieces) < len(ids):  # a prompt given as token ids: no pieces were traced
        t = Text(" ".join(map(str, ids)), "dim")
    return t


def grammar_tokens(r: RequestView) -> Text:
    """A structured output's tokens, each with how many tokens the grammar allowed when it was
    sampled ("{ 1 · "color" 1 · : 3 ...): 1 means the grammar wrote it, not the model."""
    t = Text(f"{r.grammar} grammar" + (f", compiled in {r.grammar_compile_s * 1e3:.1f} ms" if r.grammar_compile_s
                                       else "") + "; each token with the tokens its mask allowed\n", "dim")
    for piece, n in zip(r.grammar_pieces[:MAX_TOKENS_SHOWN], r.num_allowed):
        t.append(piece.replace("\n", "↵").replace(" ", "␣") or "∅", "on #303848")
        t.append(f"·{n:,} " if n is not None else "·? ", "bold yellow" if n == 1 else "dim")
    return t


def timeline_table(r: RequestView) -> Text:
    """One line per entry (plain Text, not a Rich Table: this is redrawn while tokens stream)."""
    table = Text(f" {'event':<10} {'step':>5}  {'at':<8}\n", "bold dim")
    t0 = r.arrival_ns or 0
    for e in r.timeline:
        what = e["event"]
        if what == "prefill":
            detail = f"tokens {e['from_token']}..{e['from_token'] + e['tokens'] - 1} ({e['tokens']})"
        elif what == "decode":
            detail = f"{e['steps']} step{'s' * (e['steps'] != 1)}, to step {e['last_step']}"
        else:
            detail = e.get("reason") or ""
        table.append(f" {what:<10} {e['step']:>5}  {'+' + fmt_age(e['ts_ns'] - t0):<8} {detail}\n")
    table.rstrip()
    return table


def block_table(r: RequestView, bs: int | None) -> Text:
    """logical → physical, and how full the last block is."""
    if not r.block_table:
        return Text("no blocks (waiting, preempted or finished)", "dim")
    t = Text()
    for logical, physical in enumerate(r.block_table):
        hit = physical in r.cache_hit_blocks
        t.append(f"{logical}→{physical}", "bold cyan" if hit else "")
        t.append("  ")
    if bs:
        # the KV written so far: computed tokens (the newest sampled token has no KV yet)
        used = r.num_computed_tokens - (len(r.block_table) - 1) * bs
        t.append(f"\nlast block: {max(0, min(bs, used))}/{bs} slots used", "dim")
    return t


def group_tables(frame: Frame, r: RequestView) -> Text:
    """A hybrid model: the request's table in each KV-cache group, ∅ (the null block) where its window passed."""
    groups = hybrid_cache(frame.state).get("kv_cache_groups") or []
    t = Text()
    for g, table in enumerate(r.kv_block_tables):
        spec = groups[g] if g < len(groups) else {}
        window = spec.get("sliding_window")
        t.append(f"\ngroup {g} ", "bold")
        t.append((f"sliding window {window}" if window else "full attention")
                 + (f", layers {' '.join(map(str, spec.get('layers') or []))}: " if spec else ": "), "dim")
        for logical, physical in enumerate(table):
            t.append(f"{logical}→", "dim" if not physical else "")
            t.append("∅" if not physical else str(physical), "dim" if not physical else "")
            t.append(" ")
        passed = sum(1 for b in table if not b)
        if passed:
            t.append(f" ({passed} passed by the window: back in the pool)", "yellow")
    return t


STREAM_HZ = 4  # redraws per second while the shown request only streams tokens


class RequestDetail(LinesView):
    """Shows the request `request_id` (set by whoever embeds it).

    Redrawing it renders all its lines again, so while the same request merely
    streams tokens it is redrawn at most STREAM_HZ times a second; anything else (another
    request, a new state) is drawn at once."""

    def __init__(self, request_id: str | None = None, **kwargs):
        super().__init__(**kwargs)
        self.request_id = request_id
        self._key = None
        self._drawn_at = 0.0

    def show(self, frame: Frame) -> None:
        rid = self.request_id
        r = frame.state.requests.get(rid) if rid else None
        key = (rid, None if r is None else (r.status, r.num_tokens, r.num_computed_tokens, len(r.timeline),
                                            tuple(r.block_table), len(r.prompt_pieces), r.waiting_reason, r.worker_slot,
                                            tuple(map(tuple, r.kv_block_tables)), len(r.kv_transfers),
                                            bool(frame.controller.get("paused"))))
        if key == self._key:
            return
        now = time.monotonic()
        streaming = (self._key is not None and key[0] == self._key[0] and key[1] is not None
                     and self._key[1] is not None and key[1][0] == self._key[1][0] == "RUNNING")
        if streaming and now - self._drawn_at < 1 / STREAM_HZ:
            return  # drawn on a later refresh (the key still differs then)
        self._key, self._drawn_at = key, now
        body = self
        if r is None:
            body.update(Text("Select a request (Requests panel, arrows) to see it here.", "dim"))
            return
        title = Text.assemble(("■ ", frame.color(rid)), (f"request {rid}  ", "bold"), status_text(r.status),
                              f"  prompt {r.num_prompt_tokens} tokens · generated {r.num_output_tokens}"
                              + (f"/{r.max_tokens}" if r.max_tokens else "")
                              + (f" · preempted {r.num_preemptions}×" if r.num_preemptions else "")
                              + (f" · priority {r.priority}" if r.priority else "")
                              + (f" · seed {r.seed}" if r.seed is not None else "") + worker_slot(r))
        if r.spec_history:  # speculative decoding: accepted of proposed, its latest verifications
            recent = " ".join(f"{a}/{d}" for _, d, a in r.spec_history[-12:])
            accepted = sum(a for _, _, a in r.spec_history)
            drafted = sum(d for _, d, _ in r.spec_history)
            title.append(f"\ndrafts: {accepted} of {drafted} accepted; recent steps (accepted/proposed): {recent}",
                         "magenta")
        if r.parent_id is not None:  # n > 1: one of a parent request's children
            siblings = ", ".join(s if s != rid else f"[{s}]" for s in r.sibling_ids)
            title.append(f"\nchild {r.sibling_ids.index(rid)} of {len(r.sibling_ids)} of request {r.parent_id} "
                         f"(n = {len(r.sibling_ids)}: {siblings}); they share the prompt's KV blocks", "cyan")
        # with a KV connector the engine counts the tokens it delivered as cached too: not the prefix cache's
        connector = kv_connector(frame.state)
        src = prompt_sources(r) if connector else None
        cached = r.num_cached_tokens - (src["delivered"] if src and not r.num_preemptions else 0)
        hits = (f"{cached} prompt tokens from the prefix cache (blocks "
                f"{', '.join(map(str, r.cache_hit_blocks))})" if cached > 0 else "no prefix-cache hit")
        moved = kv_transfer_section(r) if connector else None
        why = waiting_why(frame, r)
        if why and not r.status.startswith("FINISHED"):
            title.append(f"\nwaiting: {why}", "yellow")
        elif why:
            title.append(f"\nfinish reason: {why}", "dim")
        body.update_sections([
            (None, title),
            # the prompt never changes: rendered once per request (and width)
            (("prompt", rid, len(r.prompt_pieces)), Group(Text("\nprompt tokens (piece, id)", "bold"),
                                                          token_pieces(r.prompt_token_ids, r.prompt_pieces))),
            (None, Group(
                Text("\ngenerated text", "bold"), Text(r.text or "…", "green"),
                *((Text("\nstructured output", "bold"), grammar_tokens(r))
                  if r.grammar else ()),
                Text("\ntimeline", "bold"), timeline_table(r),
                Text("\nblock table (logical → physical)", "bold"), block_table(r, block_size(frame)),
                *((Text("\nper KV-cache group (a hybrid model)", "bold"), group_tables(frame, r))
                  if r.kv_block_tables else ()),
                Text("\nprefix cache", "bold"), Text(hits, "cyan" if cached > 0 else "dim"),
                *((Text("\nKV transfer (a KV connector's loads, saves, sends, receives)", "bold"), moved)
                  if moved is not None else ()))),
        ])
