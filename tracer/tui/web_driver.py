"""The Textual driver of a browser tab's `vllm-trace attach` (see tracer.tui.web).

Textual's WebDriver talks to the web server over stdin and stdout. Three ways it can outlive
its tab, each closed here:

- a "quit" (the tab closed) or SIGTERM that arrives while the app is still starting: Textual
  can lose the ExitApp it posts and then repaint for ever at 100 % CPU, a process nobody
  reads any more. Each of them now also arms a deadline after which the process exits;
- stdin at its end (the server died, or closed our pipe): WebDriver's input thread just
  stops; now the app exits;
- SIGINT and SIGTERM take the same path as "quit", deadline included.
"""
from __future__ import annotations

import asyncio
import os
import signal
import threading

from textual import messages
from textual.drivers.web_driver import WebDriver

EXIT_DEADLINE_S = 3.0  # after a request to exit: a clean exit takes well under a second


class TabDriver(WebDriver):
    """WebDriver whose every request to exit is kept, by a deadline if the app does not."""

    _deadline: threading.Timer | None = None

    def _exit_app(self) -> None:
        """Ask the app to exit (from any thread), and make sure the process does."""
        if self._deadline is None:
            self._deadline = threading.Timer(EXIT_DEADLINE_S, os._exit, (0,))
            self._deadline.daemon = True  # a clean exit ends the process before it fires
            self._deadline.start()
        self._app.post_message(messages.ExitApp())

    def start_application_mode(self) -> None:
        super().start_application_mode()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):  # replaces WebDriver's handlers, which had no deadline
            loop.add_signal_handler(sig, self._exit_app)

    def on_meta(self, packet_type: str, payload: dict[str, object]) -> None:
        if packet_type == "quit":
            self._exit_app()
            return
        super().on_meta(packet_type, payload)

    def run_input_thread(self) -> None:
        super().run_input_thread()
        if not self.exit_event.is_set():  # not the app stopping: stdin ended, nobody is left to draw for
            self._exit_app()
