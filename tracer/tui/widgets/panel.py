"""Panel: what every tab of the TUI is to the app.

The app calls ``show(frame)`` on the visible panel at every refresh; a panel may skip a redraw
while the engine runs (it throttles itself to a few redraws a second), but ``show(frame,
force=True)`` must draw: the app forces it when the panel becomes visible and when the engine
goes idle, so what a panel shows is never older than the header. Under load the app draws
the header and a ``throttled`` panel together, with ``force=True``, a few times a second. ``focus_list()`` puts the
keyboard in the panel's main list when the panel opens (arrows, enter, home/end work at once);
``open_filter()`` exists where ``filterable`` is True.
"""
from __future__ import annotations

from textual.containers import Vertical

from tracer.tui.frame import Frame

WIDE = 140  # terminal columns from which panels put things side by side (a request's detail, Step's columns)


class Panel(Vertical):
    filterable = False  # has a filter line (`/`)
    throttled = True  # under load, drawn with the header at most BUSY_HZ times a second (the app's)

    def show(self, frame: Frame, force: bool = False) -> None:
        raise NotImplementedError

    def focus_list(self) -> None:
        """Focus the panel's list (default: its first focusable widget, if any)."""
        for widget in self.query("*"):
            if widget.focusable:
                widget.focus()
                return

    @property
    def wide(self) -> bool:
        """Room to put things side by side: the panel's own width (a lesson's narration may
        take part of the terminal), plus the tab's padding, against WIDE terminal columns."""
        return self.size.width + 2 >= WIDE

    def open_filter(self) -> None:
        raise NotImplementedError(f"{type(self).__name__} has no filter")
