"""Overview: the whole engine on one screen, in the manner of htop's top section.

    waiting 2 · running 3 · finished 10     KV cache ███░░░░ 23% 15/64 blocks
    running (3)    the batch the scheduler keeps, each request's tokens and what it did this step
    waiting (2)    the queue, with the full reason each request was not admitted
    step 42        this step's batch: requests, prefill/decode tokens, the token budget used
    kernels        the last step's launches, timed, one line per kernel

The TUI opens here when the engine goes from idle to busy, so the first request a newcomer
sends is on screen without a key pressed. Redrawn at most BUSY_HZ times a second while the
engine runs (every refresh while it is held, and whenever the app forces it).
"""
from __future__ import annotations

import time

from rich.text import Text

from tracer.state import rank_of
from tracer.tui.fmt import fmt_ns, output_progress, plural, prompt_progress, status_text
from tracer.tui.frame import Frame
from tracer.tui.widgets.lines import LinesView
from tracer.tui.widgets.panel import Panel
from tracer.tui.widgets.request_detail import waiting_why

BUSY_HZ = 3  # with 64 streams every redraw differs: ~4-10 ms each on a 2-core CPU (measured), off the loop


def kv_gauge(frame: Frame, width: int = 20) -> Text:
    s = frame.state
    total = s.stats.get("num_total_blocks") or s.num_blocks or 0
    if not total:
        return Text("KV cache: not allocated yet", "dim")
    used = total - s.stats.get("num_free_blocks", total)
    usage = used / total
    filled = round(usage * width)
    return Text.assemble("KV cache ", ("█" * filled, "green" if usage < 0.8 else "red"),
                         ("░" * (width - filled), "dim"), f" {usage:.0%} · {used}/{total} blocks")


def this_step(frame: Frame) -> dict:
    """request id -> what the current step's batch does for it ("prefill 11" / "decode 1")."""
    s = frame.state
    snap = s.snapshot if s.snapshot_step == s.step and s.snapshot else {}
    return {sch["request_id"]: f"{sch['kind']} {sch['num_tokens']}" for sch in snap.get("scheduled", [])}


def rank0_launches(kernels: list[dict]) -> list[dict]:
    return [k for k in kernels if rank_of(k) == 0]


def kernel_lines(kernels: list[dict], limit: int) -> list[Text]:
    """One line per kernel of a step's launches: how many, total time, time per launch (rank
    0's with tensor parallelism: every rank does the same launches), the longest ones first (the
    step's few input-building launches come before its layers'; a profiled step has every op as a
    launch)."""
    per: dict[str, list[int]] = {}
    for k in rank0_launches(kernels):
        per.setdefault(k["name"], []).append(k.get("duration_ns") or 0)
    items = sorted(per.items(), key=lambda kv: -sum(kv[1]))
    lines = []
    for name, times in items[:limit]:
        lines.append(Text.assemble(f"  {name:<24}", (f"{len(times):>3}×", "dim"), f"  {fmt_ns(sum(times)):>9} total",
                                   (f"  {fmt_ns(sum(times) / len(times))} each", "dim")))
    return lines


def overview(frame: Frame, width: int, height: int) -> Text:
    s, c = frame.state, frame.controller
    t = Text()
    head = Text.assemble(("waiting ", "yellow"), (str(len(s.waiting)), "bold"), " · ", ("running ", "green"),
                         (str(len(s.running)), "bold"), " · ", ("finished ", "dim"), (str(len(s.finished)), "bold"))
    gauge = kv_gauge(frame, max(10, min(30, width - 70)))
    t.append_text(head)
    t.append(" " * max(3, width - len(head) - len(gauge)) if width >= len(head) + len(gauge) + 3 else "\n")
    t.append_text(gauge)
    # rows for the two queues: what is left after the fixed lines, shared, each at least 2
    idle, *_, kernels = shown_step(s)
    fixed = 10 + (idle is not None) + min(4, len({k["name"] for k in kernels}))
    budget = max(4, height - fixed)
    n_run = min(len(s.running), max(2, budget - min(len(s.waiting), budget // 2)))
    n_wait = min(len(s.waiting), max(2, budget - n_run))
    doing = this_step(frame)
    t.append("\n\nrunning", "bold green")
    t.append(f"  ({plural(len(s.running), 'request')} in the batch the scheduler keeps)\n" if s.running
             else "  (none: no request holds KV blocks)\n", "dim")
    idw = min(24, max([10] + [len(r) for r in s.running[:n_run] + s.waiting[:n_wait] + s.finished[-3:]]))
    for rid in s.running[:n_run]:
        r = s.requests[rid]
        prompt, out = prompt_progress(r), output_progress(r)  # as the Requests panel counts them
        t.append("  ■ ", frame.color(rid))
        t.append(f"{rid[:idw]:<{idw}}", "bold" if rid == frame.selected else "")
        if width >= 100:
            t.append(f"  prompt {prompt:>11} computed  output {out:<9}")
            t.append(f"this step: {doing[rid]}\n" if rid in doing else "\n", "cyan")
        else:
            t.append(f" prompt {prompt:>9} · out {out:<7}")
            t.append(f" {doing[rid]}\n" if rid in doing else "\n", "cyan")
    if len(s.running) > n_run:
        t.append(f"  … {len(s.running) - n_run} more (Requests, 2)\n", "dim")
    t.append("\nwaiting", "bold yellow")
    t.append(f"  ({plural(len(s.waiting), 'request')} queued, each with the reason it was not admitted)\n"
             if s.waiting else "  (none)\n", "dim")
    for rid in s.waiting[:n_wait]:
        r = s.requests[rid]
        t.append("  ■ ", frame.color(rid))
        t.append(f"{rid[:idw]:<{idw}}  ", "bold" if rid == frame.selected else "")
        t.append_text(status_text(r.status))
        t.append(f"  {waiting_why(frame, r) or 'arrived after this step was scheduled'}\n", "yellow")
    if len(s.waiting) > n_wait:
        t.append(f"  … {len(s.waiting) - n_wait} more (Requests, 2)\n", "dim")
    # the newest finished ones, while there is room (a short request is gone before a key is pressed)
    n_done = min(len(s.finished), 3, max(0, budget - n_run - n_wait - 1))
    if n_done:
        t.append("\nfinished", "bold")
        t.append(f"  ({len(s.finished)}, newest first)\n", "dim")
        for rid in reversed(s.finished[-n_done:]):
            r = s.requests[rid]
            t.append("  ■ ", frame.color(rid))
            t.append(f"{rid[:idw]:<{idw}}", "bold" if rid == frame.selected else "")
            t.append(f"  {plural(r.num_output_tokens, 'token')} out, {r.finish_reason or '?'}", "dim")
            t.append(f"  {r.text[:max(0, width - idw - 30)]!r}\n" if r.text else "\n", "green")
    t.append("\n")
    step_lines(t, s, width)
    if c.get("replay"):  # no engine behind a recording: it can only be travelled through
        t.append("\nA recorded trace: ← / → move a step, home / end go to the first / last.", "dim")
    elif c.get("paused"):
        t.append("\nThe engine is held: n runs one step, space lets it run.", "dim")
    t.rstrip()
    return t


def shown_step(s) -> tuple:
    """(the step that scheduled nothing, or None; the step shown, its phase, snapshot and launches)."""
    snap = s.snapshot if s.snapshot_step == s.step and s.snapshot else None
    if snap is not None and not snap.get("scheduled") and s.last_batch is not None:
        last = s.last_batch
        return s.step, last["step"], "done", last["snapshot"], last["kernels"]
    return None, s.step, s.phase, snap, s.kernels


def step_lines(t: Text, s, width: int) -> None:
    """The step's batch and its launches. A step that scheduled no request (under async scheduling
    the last one, scheduled while the step before it was still deciding its requests' last tokens)
    ran no batch and launched nothing: the last step that ran one is shown instead."""
    idle, step, phase, snap, kernels = shown_step(s)
    if step is None:
        t.append("step -", "bold")
        t.append("  no step yet: send a request (the Startup panel, 7, has a curl line)\n", "dim")
    elif snap is None:
        t.append(f"step {step}", "bold")
        t.append("  the scheduler has not run yet in this step\n", "dim")
    else:
        kinds = [sch["kind"] for sch in snap.get("scheduled", [])]
        t.append(f"step {step}", "bold")
        t.append(f" ({phase}) batch: {plural(len(kinds), 'request')}, {kinds.count('prefill')} prefill "
                 f"{kinds.count('decode')} decode, {snap.get('total_num_scheduled_tokens', 0)}/"
                 f"{snap.get('token_budget', 0)} tokens" + (" (Step, 4)\n" if width >= 100 else "\n"))
        if idle is not None:
            t.append(f"  the last step that ran a batch (step {idle} scheduled no request)\n", "dim")
    if kernels:
        t.append(f"kernels of step {step}", "bold")
        n = len(rank0_launches(kernels))
        ranks = f" on rank 0 of {s.tensor_parallel_size}" if s.tensor_parallel_size > 1 else ""
        t.append(f"  ({plural(n, 'launch')}{ranks}; Kernels, 5)\n", "dim")
        for line in kernel_lines(kernels, 4):
            t.append_text(line)
            t.append("\n")
    elif s.kernel_history and idle is None:  # mid-step (launches are published after the forward pass): the last's
        t.append("kernels of the last step", "bold")
        t.append("  (all layers; Kernels, 5)\n", "dim")
        for name, times in sorted(s.kernel_history.items(), key=lambda kv: -kv[1][-1])[:4]:  # the longest
            t.append(f"  {name:<24}        {fmt_ns(times[-1]):>9} total\n")
    elif step is not None:
        t.append("kernels", "bold")
        t.append("  no launch yet in this step\n", "dim")


class OverviewPanel(Panel):
    def compose(self):
        yield LinesView(id="overview-body")

    def on_mount(self) -> None:
        self._key = None
        self._drawn_at = 0.0

    def show(self, frame: Frame, force: bool = False) -> None:
        s = frame.state
        body = self.query_one("#overview-body", LinesView)
        if not body.size.width:
            return  # not laid out yet: the lines are sized to fit, so draw once the width is known
        key = (s.last_seq, frame.selected, frame.controller.get("paused"), self.size, body.size)
        now = time.monotonic()
        if not force and (key == self._key or (not frame.controller.get("paused")
                                               and now - self._drawn_at < 1 / BUSY_HZ)):
            return  # (a skipped change is drawn by a later refresh: the key still differs then)
        self._key, self._drawn_at = key, now
        # one line of segments per line of text, no Rich layout: the lines are sized to fit
        console = self.app.console
        # lines sized to fit beside a vertical scrollbar: one line too wide scrolled the whole body
        # sideways (the gauge cut to `0/4095 bloc`, a stray scrollbar thumb in the corner)
        width = body.size.width - body.styles.scrollbar_size_vertical
        text = overview(frame, width, body.size.height)
        lines = text.split("\n")
        for line in lines:  # a long request id or reason: cut, never a sideways scroll
            line.truncate(width, overflow="ellipsis")
        body.update_rows([list(line.render(console)) for line in lines])
