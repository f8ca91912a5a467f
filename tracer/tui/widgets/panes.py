"""Panes: the app's tabbed panels, switched only by the app (a key, a click on a tab, or following new work).

Textual's TabbedContent also switches to a pane when a widget inside it takes the focus. The app
focuses a panel's list once that panel is shown, and that focus lands a few messages later: a key
pressed meanwhile (the Overview opened for new work, then `4` at once) would see its panel switched
back by that late focus. Here a focus never switches panes; nothing in the app focuses a hidden panel.
"""
from __future__ import annotations

from textual.widgets import TabbedContent, TabPane


class Panes(TabbedContent):
    def on_tab_pane_focused(self, event: TabPane.Focused) -> None:
        event.stop()
        event.prevent_default()  # (TabbedContent's own handler would make that pane the active one)
