"""`b`: the breakpoints. Type a condition and press enter to add it; select one and press
delete (or d) to remove it. The engine holds at its next control point after a match."""
from __future__ import annotations

from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, Label, OptionList
from textual.widgets.option_list import Option

from tracer.conditions import parse_condition

SYNTAX = ("arrive[:ID]  finish[:ID]  preempt[:ID]  request:ID  layer:LAYER  kernel:NAME  event:LAYER.NAME  "
          "expert:LAYER:EXPERT\n"
          "e.g. 'finish' (any request finishes), 'preempt', 'kernel:unified_attention', 'request:cmpl-3', "
          "'expert:0:3' (a mixture of experts: layer 0's expert 3 receives tokens)")


class BreakpointsScreen(ModalScreen):
    BINDINGS = [Binding("escape", "app.pop_screen", "close"),
                Binding("delete,d", "remove", "remove selected")]

    def __init__(self, source):
        super().__init__()
        self.source = source

    def compose(self):
        with Vertical(id="breakpoints"):
            yield Label("[b]Breakpoints[/b]: the engine holds when an event matches")
            yield OptionList(id="bp-list")
            yield Input(placeholder="new condition, e.g. finish or preempt or kernel:unified_attention", id="bp-input")
            yield Label(SYNTAX, id="bp-syntax")
            yield Label("", id="bp-error")

    def on_mount(self) -> None:
        self._fill()
        self.query_one(Input).focus()

    def _fill(self) -> None:
        bps = self.source.controller().get("breakpoints", [])
        opts = self.query_one(OptionList)
        opts.clear_options()
        opts.add_options([Option(b, id=b) for b in bps] or [Option("(none)", disabled=True)])
        if bps:
            opts.highlighted = 0

    async def on_input_submitted(self, event: Input.Submitted) -> None:
        text = event.value.strip()
        if not text:
            return
        try:
            parse_condition(text)  # say what is wrong here, before it travels anywhere
            await self.source.add_breakpoint(text)
        except Exception as e:  # a bad condition or a refused command: show it, stay open
            self.query_one("#bp-error", Label).update(f"[red]{e}[/red]")
            return
        self.query_one("#bp-error", Label).update("")
        event.input.value = ""
        self._fill()

    async def action_remove(self) -> None:
        opts = self.query_one(OptionList)
        if opts.highlighted is None:
            return
        option = opts.get_option_at_index(opts.highlighted)
        if option.id:
            await self.source.remove_breakpoint(option.id)
            self._fill()
