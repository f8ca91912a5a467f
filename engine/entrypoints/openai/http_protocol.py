"""uvicorn's h11 HTTP protocol with a deadline for each request's head.

uvicorn closes a connection that sits idle *after* a response (``timeout_keep_alive``), but
none that never sends a request, or sends half of its headers and stops: such connections are
held for ever, each a socket and a slot (a "slowloris" client needs no bandwidth to hold
hundreds). Here a connection must deliver a complete request line and headers within
HEADER_TIMEOUT_S of its first byte being awaited: from when it opens, or from the first byte
of its next request on a kept-alive connection (before that byte, uvicorn's keep-alive
timeout applies). It is then closed without an answer, as uvicorn closes an idle one. A
request body is not timed here: the body-size cap bounds it, and a slow upload of a big
prompt is legitimate.
"""
from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

HEADER_TIMEOUT_S = 10.0


class HeaderTimeoutH11Protocol(H11Protocol):
    header_timeout = HEADER_TIMEOUT_S

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._head_timer: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        self._arm_head_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE:  # a request begun and not yet whole (or the next one)
            self._arm_head_timer()
        else:
            self._cancel_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def _arm_head_timer(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.header_timeout, self._head_timeout)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timeout(self) -> None:
        self._head_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


def with_header_timeout(seconds: float) -> type[HeaderTimeoutH11Protocol]:
    """The protocol class with another deadline (uvicorn.Config(http=...) takes a class)."""
    return type("HeaderTimeoutH11Protocol", (HeaderTimeoutH11Protocol,), {"header_timeout": seconds})
