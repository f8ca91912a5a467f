"""`enter` on a request: its full detail, kept current while it runs."""
from __future__ import annotations

from textual.binding import Binding
from textual.screen import ModalScreen

from tracer.tui.widgets.request_detail import RequestDetail


class RequestScreen(ModalScreen):
    BINDINGS = [Binding("escape,enter,q", "app.pop_screen", "close")]

    def __init__(self, request_id: str):
        super().__init__()
        self.request_id = request_id
        self.detail = RequestDetail(request_id, id="request-screen-detail")

    def compose(self):
        yield self.detail

    def on_mount(self) -> None:
        if self.app.frame is not None:  # at once, not at the next refresh
            self.show(self.app.frame)

    def show(self, frame) -> None:
        # The app's timer may fire while this screen is still mounting or already closing.
        if self.detail.is_mounted and self.detail.is_attached:
            self.detail.show(frame)
