"""The header: what is being traced, and whether the engine runs, is held, is stepping or died.

Line one never wraps: the queue sizes are spelled out (`waiting 0 · running 3 · finished 1`)
and abbreviated (`W0 R3 F1`), the title and then the URL dropped, only when the terminal is too
narrow for them. Line two says what a held engine is waiting for, in words.
"""
from __future__ import annotations

from rich.text import Text

from engine.trace_names import is_attention_kernel
from tracer.state import hybrid_cache
from tracer.tui.fmt import hybrid_fit, speculation
from tracer.tui.frame import Frame
from tracer.tui.sources.base import SourceInfo
from tracer.tui.widgets.lines import FixedText

POINTS = {  # where the engine holds -> what it is waiting to do
    "step": "before step {step}: n runs it, space lets the engine run",
    "execute": "after scheduling step {step}, before execute_model (its forward pass): s goes on to the next phase",
    "grammar_bitmask": "after the forward pass of step {step}, before the grammar bitmask: s goes on",
    "sample_tokens": "after the grammar bitmask of step {step}, before sample_tokens: s goes on",
    "postprocess": "after sampling step {step}, before update_from_output appends its tokens: s goes on",
    "kernel": "before the kernel launch {name}{layer} of step {step}: k runs it",
    "step_end": "at the end of step {step}, its tokens out: n runs the next step",
}
WHY = {"pause": "you paused (space)", "step step": "you stepped over a step (n)",
       "step phase": "you stepped to the next phase (s)", "step kernel": "you stepped to the next kernel launch (k)"}


def engine_mode(frame: Frame, stepping: bool, mode: str, connected: bool = True) -> tuple[str, str]:
    """(label, style) for the engine's state."""
    c = frame.controller
    if not connected:
        return "DISCONNECTED", "bold white on red"
    if frame.state.engine_dead:
        return "ENGINE DEAD", "bold white on red"
    if mode == "replay":
        return "REPLAY", "bold black on #61afef"
    if c.get("paused"):
        return "PAUSED", "bold black on yellow"
    if stepping:
        return "STEPPING", "bold black on #c678dd"
    if c.get("pause_requested"):  # the engine will hold at its next step boundary (idle: once work arrives)
        return "PAUSED", "bold black on yellow"
    return "RUNNING", "bold black on green"


def held_text(frame: Frame) -> str:
    """'held before step 4: n runs it, … (you paused (space))'."""
    c = frame.controller
    if c.get("point") not in POINTS:  # a point a source defines itself (a lesson's checkpoint)
        return f"held at {c.get('point')}: {c.get('reason') or ''}"
    info = (frame.state.paused_at or {}).get("info") or {}
    step = c.get("step") if c.get("step") is not None else frame.state.step
    layer = info.get("layer_idx", "?")  # None: a launch of no layer (building the inputs, sampling)
    what = POINTS[c.get("point")].format(step=step, point=c.get("point"), name=info.get("name", "?"),
                                         layer="" if layer is None else f" (layer {layer})")
    if c.get("point") == "step" and info.get("schedules") is False:  # async: the call only waits for a step
        what = f"before the call that executes step {step} (nothing left to schedule): n runs it"
    if c.get("point") == "kernel" and is_attention_kernel(info.get("name")):
        what += ", t runs it on Triton"
    reason = c.get("reason") or ""
    did = last_call_text(frame.state)
    if reason == "step step" and did:  # async scheduling: n is one step_with_batch_queue call
        return f"held {what} (n ran one call: {did})"
    return f"held {what} ({WHY.get(reason, reason)})"


def last_call_text(s) -> str:
    """Async scheduling: what the last step_with_batch_queue call did: 'scheduled step 13', 'executed
    step 12' (its outputs are out) or 'both: scheduled step 13, executed step 12' ('' without one)."""
    call = s.last_call or {}
    did = [f"{key} step {call[key]}" for key in ("scheduled", "executed") if call.get(key) is not None]
    return "both: " + ", ".join(did) if len(did) == 2 else "".join(did)


def in_flight_text(s, shown_step: int | None) -> str:
    """Async scheduling: 'in flight: step 12 (executing), step 13 (scheduled)'; '' while no step but
    the one shown is in flight (its phase says it all)."""
    if all(step == shown_step for step, _ in s.in_flight):
        return ""
    return "in flight: " + ", ".join(f"step {step} ({status})" for step, status in s.in_flight)


def queue_counts(frame: Frame, short: bool) -> str:
    s = frame.state
    w, r = len(s.waiting), len(s.running)
    f = max(s.num_finished, len(s.finished))  # all that finished, not only the ones kept
    return f"W{w} R{r} F{f}" if short else f"waiting {w} · running {r} · finished {f}"


class StatusHeader(FixedText):
    """model · device · backend │ STATE step N (phase) [PROFILING] │ waiting · running · finished │ URL"""

    def __init__(self, info: SourceInfo, **kwargs):
        super().__init__(Text(""), **kwargs)
        self.info = info
        self.connection: str | None = None  # attach: why it is disconnected (None: connected)

    def show(self, frame: Frame, stepping: bool = False) -> None:
        s, c, info = frame.state, frame.controller, self.info
        label, style = engine_mode(frame, stepping, info.mode, self.connection is None)
        shown_step = s.done_step if info.mode == "replay" and s.done_step is not None else s.step
        step = "-" if shown_step is None else str(shown_step)
        # the phase of the step shown, as the Step panel says it (where a hold is, line two says);
        # a replay moves from step to step, each done
        where = s.phase if info.mode != "replay" else None
        flight = in_flight_text(s, shown_step)
        travel = (f"/{c['first_step']}..{c['last_step']}" if info.mode == "replay" and c.get("last_step") is not None
                  else "")
        width = self.size.width or 80
        spec = speculation(s.engine_config, short=True)
        spec = f" · {spec}" if spec else ""
        fit = hybrid_fit(hybrid_cache(s))  # a sliding-window model: the requests the hybrid cache fits
        line = None
        for title, short, url in ((True, False, True), (False, False, True), (False, True, True), (False, True, False),
                                  (False, True, None)):
            t = Text.assemble((" vllm-trace " if title else "", "bold reverse"), " ", (info.model, "bold"),
                              f" · {info.device} · {info.backend}{spec} ", (f" {label} ", style),
                              (f" step {step}", "bold"))
            if where and url is not None:
                t.append(f" ({where})", "dim")
            if flight and url is not None:
                t.append(f"  {flight}", "dim" if short else "")
            t.append(travel, "dim")
            if fit and not short:
                t.append(f"  {fit}", "cyan")
            if s.profiling:  # every op of the forward pass is a launch (p, or POST /start_profile)
                t.append(" ")
                t.append(" PROFILING ", "bold black on #e5c07b")
            t.append(f"  {queue_counts(frame, short)}")
            if url and info.url:
                t.append("  " + info.url, "underline" if info.mode != "replay" else "")
            if t.cell_len <= width:
                line = t
                break
        line = line or t
        line.no_wrap, line.overflow = True, "ellipsis"
        if self.connection is not None:
            line.append(f"\n lost the server: {self.connection}; retrying", "bold red")
        elif s.engine_dead:
            line.append(f"\n {s.engine_dead}: requests in flight failed, new ones get 503", "bold red")
        elif c.get("paused") and c.get("reason"):
            line.append(f"\n {held_text(frame)}", "yellow")
        elif c.get("pause_requested"):
            line.append("\n will hold before the next step", "yellow")
        elif s.events_missed:
            line.append(f"\n {s.events_missed} events missed (the viewer fell behind)", "red")
        self.update(line)
