"""The app on uvicorn in a background thread, on a free loopback port: for lessons and tests
that serve and call the server from the same process."""
from __future__ import annotations

import threading

import uvicorn

from engine.entrypoints.openai.http_protocol import HEADER_TIMEOUT_S, with_header_timeout
from engine.entrypoints.sockets import tcp_socket


class BackgroundServer(uvicorn.Server):
    """uvicorn in a thread; `ready` is set once it accepts connections."""

    def __init__(self, config: uvicorn.Config):
        super().__init__(config)
        self.ready = threading.Event()

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            self.ready.set()

    def install_signal_handlers(self) -> None:  # not the main thread: Ctrl-C stays with the caller
        pass


def start_background(app, timeout: float = 60,
                     header_timeout: float = HEADER_TIMEOUT_S) -> tuple[BackgroundServer, threading.Thread, str]:
    """Serve `app` on 127.0.0.1 (a free port); returns (server, thread, base URL) once ready.
    Stop it with ``server.should_exit = True; thread.join()``. header_timeout: see http_protocol."""
    sock = tcp_socket()
    sock.bind(("127.0.0.1", 0))
    server = BackgroundServer(uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5,
                                             http=with_header_timeout(header_timeout)))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    if not server.ready.wait(timeout):
        server.should_exit = True
        raise RuntimeError(f"the server did not start within {timeout} s")
    return server, thread, f"http://127.0.0.1:{sock.getsockname()[1]}"
