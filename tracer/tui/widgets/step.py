"""Step: what the scheduler put in this step's batch, and what the model runner fed the model.

The batch and the decisions come from the schedule snapshot (taken at schedule time); the
flattened inputs from the model runner's batch event. For the chosen request (the one
selected in Requests, else the first in the batch) its slice of the flattened arrays is
shown: its token ids, their positions, and the cache slots they are written to
(slot = physical block × block size + offset).

With tensor parallelism a line per rank says what its worker received this step (its
tokens and the digest of the scheduler output): the same on every rank.
"""
from __future__ import annotations

import time

from rich.console import Group
from rich.table import Table
from rich.text import Text
from textual.containers import Horizontal

from tracer.tui.fmt import plural
from tracer.tui.frame import Frame
from tracer.tui.widgets.lines import LinesView
from tracer.tui.widgets.panel import Panel
from tracer.tui.widgets.request_detail import block_size
from tracer.tui.widgets.routing import RoutingView
from tracer.tui.widgets.timeline import AsyncTimeline

BUSY_HZ = 4  # redraws per second at most while the engine runs (every step when paused or stepping)
MAX_ITEMS = 48  # flattened values shown per array (a long prefill is cut, with a count)


def _ints(values: list, limit: int = MAX_ITEMS) -> str:
    s = " ".join(map(str, values[:limit]))
    return s + (f" … +{len(values) - limit}" if len(values) > limit else "")


def drafts_line(v: dict, indent: int) -> Text:
    """A request's verified drafts: accepted ones green, rejected ones struck, then the target's token."""
    line = Text(" " * (indent + 2) + " drafts ", "dim")
    for t in v.get("accepted", ()):
        line.append(f"{t} ", "green")
    for t in v.get("rejected", ()):
        line.append(f"{t}", "red strike")
        line.append(" ")
    line.append(f"→ {v.get('token')}" + (" (bonus)" if v.get("bonus") else " (the target's)"), "bold")
    line.append("\n")
    return line


def grammar_cut_line(v: dict, indent: int) -> Text:
    """The drafts a request's grammar cut before verification (never sent to the model)."""
    line = Text(" " * (indent + 2) + f" ✂ the grammar cut {plural(len(v['cut']), 'draft')}: ", "yellow")
    line.append(" ".join(map(str, v["cut"])), "yellow strike")
    line.append(f" (kept {len(v.get('kept', ()))} of {len(v.get('draft', ()))})\n", "dim")
    return line


def batch_table(frame: Frame) -> Group | Text:
    s = frame.state
    snap = s.snapshot if s.snapshot_step == s.step else None
    if snap is None:
        return Text("no batch yet in this step (the scheduler has not run)" if s.step is not None
                    else "no step yet: send a request", "dim")
    # Plain aligned text, not a Rich Table: a table of 64 rows costs tens of milliseconds to
    # render, taken from the engine thread (same interpreter lock) several times a second.
    rows = snap.get("scheduled", [])
    w = max([7] + [len(sch["request_id"]) for sch in rows]) + 2
    mask = s.grammar_mask if (s.grammar_mask or {}).get("step") == s.step else {}  # filled after the schedule
    allowed, vocab = mask.get("num_allowed") or {}, mask.get("vocab_size") or 0
    table = Text(f"{'request':<{w + 2}} {'kind':<8}{'tokens':>6} {'from':>6}  computed/total\n", "bold dim")
    for sch in rows:
        rid = sch["request_id"]
        r = s.requests.get(rid)
        total = r.num_tokens if r else "?"
        table.append("■ ", frame.color(rid))
        table.append(f"{rid:<{w}}", "bold" if rid == frame.selected else "")
        table.append(f" {sch['kind']:<8}", "magenta" if sch["kind"] == "prefill" else "cyan")
        table.append(f"{sch['num_tokens']:>6} {sch['num_computed_before']:>6}  "
                     f"{sch['num_computed_before'] + sch['num_tokens']}/{total}")
        if rid in allowed:  # a structured output: the grammar's mask decides this step's token
            table.append(f"  ◆ grammar: {allowed[rid]:,} of {vocab:,} tokens allowed", "yellow")
            per_pos = ((s.grammar_mask or {}).get("num_allowed_per_pos") or {}).get(rid)
            if per_pos:  # speculation: a mask per draft position too
                table.append(f", then {', '.join(f'{n:,}' for n in per_pos[1:])} after each draft", "yellow")
        table.append("\n")
        if rid in s.verified:
            table.append_text(drafts_line(s.verified[rid], w))
        cut = s.drafts_cut.get(s.step, {}).get(rid)
        if cut and cut.get("cut"):
            table.append_text(grammar_cut_line(cut, w))
    table.rstrip()
    used, budget = snap.get("total_num_scheduled_tokens", 0), snap.get("token_budget", 0)
    n = len(snap.get("scheduled", []))
    head = Text.assemble((f"step {s.step}", "bold"), f"  batch of {n} request{'' if n == 1 else 's'}, ",
                         (f"{used}", "bold"), f"/{budget} tokens of the budget")
    drafted = s.stats.get("spec_num_draft_tokens", 0)
    if drafted:  # speculative decoding: how it pays so far
        accepted, drafts = s.stats.get("spec_num_accepted_tokens", 0), s.stats.get("spec_num_drafts", 1)
        head.append(f"\nspeculation: {accepted / drafted:.0%} of {drafted} draft tokens accepted, "
                    f"{accepted / max(1, drafts):.2f} a draft", "dim")
    return Group(head, table)


def decisions(frame: Frame) -> Group | Text:
    s = frame.state
    snap = s.snapshot if s.snapshot_step == s.step else None
    if snap is None:
        return Text("")
    out = [Text("scheduler decisions", "bold")]
    admitted = snap.get("admitted", [])
    out.append(Text(f"admitted: {', '.join(admitted) or 'none'}", "green" if admitted else "dim"))
    for rid in snap.get("preempted", []):
        r = s.requests.get(rid)
        out.append(Text(f"preempted {rid}: {r.preempt_reason if r else '?'}", "bold red"))
    reasons = snap.get("waiting_reasons", {})
    for rid, why in reasons.items():
        out.append(Text(f"waiting {rid}: {why}", "yellow"))
    if not reasons and not snap.get("preempted"):
        out.append(Text("no request left waiting, none preempted", "dim"))
    sent = sent_line(snap.get("scheduler_output"), (s.batch or {}) if (s.batch or {}).get("slots") else {})
    if sent is not None:
        out.append(sent)
    return Group(*out)


def sent_line(diff: dict | None, batch: dict) -> Text | None:
    """What the SchedulerOutput told the workers: who came whole (NewRequestData), who as a diff
    (CachedRequestData), its size, and the slot each request holds in the worker's persistent batch."""
    if not diff:
        return None
    t = Text("sent to the workers: ", "bold")
    t.append(f"{diff['num_bytes']:,} bytes; ")
    new = [rid + (" (resumed)" if rid in diff.get("resumed", ()) else "") for rid in diff["new"]]
    t.append(f"new (whole): {', '.join(new) or 'none'}; ", "green" if new else "dim")
    cached = diff["cached"]
    t.append(f"cached (diff): {', '.join(cached) or 'none'}", "" if cached else "dim")
    for key in ("preempted", "finished"):
        if diff[key]:
            t.append(f"; {key}: {', '.join(diff[key])}")
    slots = dict(zip(batch.get("request_ids", []), batch.get("slots", [])))
    if slots:
        t.append("\nworker slots: " + ", ".join(f"{rid} → {slot}" for rid, slot in slots.items()), "dim")
    return t


def workers_received(frame: Frame) -> Text | None:
    """Each rank's execute_model of this step; None with one rank."""
    s = frame.state
    got = [w["execute_model"] for w in s.workers if (w.get("execute_model") or {}).get("step") == s.step]
    if not s.workers:
        return None
    t = Text("workers", "bold")
    if not got:
        return t.append(": no scheduler output received yet in this step", "dim")
    for e in got:
        n, m = e.get("total_num_scheduled_tokens") or 0, len(e.get("num_scheduled_tokens") or {})
        t.append(f"\nrank {e['rank']}: {n} token{'' if n == 1 else 's'} of {m} request{'' if m == 1 else 's'}, "
                 f"digest {e.get('digest')}")
    same = len({e.get("digest") for e in got}) == 1
    if len(got) == len(s.workers):
        t.append("\nthe same scheduler output on every rank" if same else "\nthe ranks received different outputs!",
                 "green" if same else "bold red")
    return t


def flattened_inputs(frame: Frame) -> Group | Text:
    b = frame.state.batch
    if b is None:
        return Text("flattened inputs: the model runner has not built this step's batch yet", "dim")
    ids = b.get("request_ids", [])
    rid = frame.selected if frame.selected in ids else (ids[0] if ids else None)
    if rid is None:
        return Text("empty batch", "dim")
    i = ids.index(rid)
    qsl = b["query_start_loc"]
    lo, hi = qsl[i], qsl[i + 1]
    bs = block_size(frame)
    slots = b["slot_mapping"][lo:hi]
    where = [f"{x // bs}:{x % bs}" for x in slots] if bs else []
    t = Table(box=None, padding=(0, 1), show_header=False)
    t.add_column(style="bold dim", no_wrap=True)
    t.add_column()
    t.add_row("input_ids", _ints(b["input_ids"][lo:hi]))
    t.add_row("positions", _ints(b["positions"][lo:hi]))
    t.add_row("slot_mapping", _ints(slots))
    if where:
        t.add_row("  block:offset", " ".join(where[:MAX_ITEMS]))
    t.add_row("seq_len", str(b["seq_lens"][i]))
    t.add_row("query_start_loc", f"{_ints(qsl, 16)}   (this request: rows {lo}..{hi - 1})")
    t.add_row("block_table", _ints(b["block_tables"][i]))
    size = f"  ({plural(len(ids), 'request')}, {plural(len(b['input_ids']), 'token')} in the batch)"
    return Group(Text.assemble(("flattened inputs of request ", "bold"), (rid, f"bold {frame.color(rid)}"),
                               (size, "dim")), t)


class StepPanel(Panel):
    def compose(self):
        yield AsyncTimeline(id="step-timeline")  # async scheduling only: the core's thread beside the forward pass
        yield RoutingView(id="step-routing")  # a mixture of experts only: tokens per expert, per layer
        with Horizontal(id="step-columns"):
            yield LinesView(id="step-left")
            yield LinesView(id="step-right")

    def on_mount(self) -> None:
        self._key = None
        self._drawn_at = 0.0

    def on_resize(self) -> None:
        self.set_class(not self.wide, "-narrow")

    def show(self, frame: Frame, force: bool = False) -> None:
        s = frame.state
        received = tuple((w.get("execute_model") or {}).get("step") for w in s.workers)
        key = (s.step, s.phase, s.snapshot_step, s.batch is not None, frame.selected, len(s.requests), received,
               s.timeline[-1:] and tuple(s.timeline[-1]), s.done_step, s.routing_step, len(s.routing))
        now = time.monotonic()
        if not force and (key == self._key or (not frame.controller.get("paused")
                                               and now - self._drawn_at < 1 / BUSY_HZ)):
            return  # (a skipped change is drawn by a later refresh: the key still differs then)
        self._key, self._drawn_at = key, now
        self.query_one(AsyncTimeline).show(frame)
        self.query_one(RoutingView).show(frame)
        workers = workers_received(frame)
        left = (batch_table(frame), decisions(frame)) + ((Text(""), workers) if workers is not None else ())
        self.query_one("#step-left", LinesView).update(Group(*left))
        self.query_one("#step-right", LinesView).update(flattened_inputs(frame))
