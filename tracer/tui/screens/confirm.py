"""Quit while requests are in flight? (They would be drained for a few seconds, then aborted.)"""
from __future__ import annotations

from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Label


class ConfirmQuit(ModalScreen[bool]):
    BINDINGS = [Binding("y", "answer(True)", "yes, quit"), Binding("n,escape", "answer(False)", "no")]

    def __init__(self, in_flight: int):
        super().__init__()
        self.in_flight = in_flight

    def compose(self):
        with Vertical(id="confirm"):
            yield Label(f"{self.in_flight} request{'s' * (self.in_flight != 1)} in flight.")
            yield Label("Quit anyway? In-flight requests get the drain timeout, then are aborted.  [b]y[/] / [b]n[/]")

    def action_answer(self, yes: bool) -> None:
        self.dismiss(yes)
