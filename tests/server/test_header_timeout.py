"""A connection that never sends a whole request head is closed (uvicorn alone held idle and
half-sent connections for ever); whole requests, slow bodies and kept-alive connections are not."""
from __future__ import annotations

import socket
import time

import pytest
from fastapi import FastAPI, Request

from engine.entrypoints.openai.background import start_background
from engine.entrypoints.openai.http_protocol import HEADER_TIMEOUT_S, HeaderTimeoutH11Protocol

TIMEOUT = 1.0


@pytest.fixture(scope="module")
def url():
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request) -> dict:
        return {"n": len(await request.body())}

    server, thread, url = start_background(app, header_timeout=TIMEOUT)
    yield url
    server.should_exit = True
    thread.join(10)


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=30)


def _closed_after(sock: socket.socket) -> float:
    """Seconds until the server closes the connection (recv returns b"" or the peer resets)."""
    t0 = time.monotonic()
    try:
        while sock.recv(4096):
            pass
    except ConnectionResetError:
        pass
    return time.monotonic() - t0


def _response(sock: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"}"):  # the echo's JSON body ends the response
        chunk = sock.recv(4096)
        assert chunk, f"closed after {data!r}"
        data += chunk
    return data


def _request(body: bytes) -> bytes:
    return b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)


def test_idle_and_half_sent_connections_are_closed(url):
    idle = [_connect(url) for _ in range(20)]
    half = [_connect(url) for _ in range(20)]
    for s in half:
        s.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Le")
    t0 = time.monotonic()
    waits = [_closed_after(s) for s in idle + half]
    assert time.monotonic() - t0 < TIMEOUT + 20, waits  # closed by the header timeout, not held (margin: a loaded CPU)
    for s in idle + half:
        s.close()


@pytest.mark.slow
def test_whole_requests_slow_bodies_and_keep_alive_are_served(url):
    with _connect(url) as s:
        head, body = _request(b"x" * 10).split(b"\r\n\r\n")
        s.sendall(head + b"\r\n\r\n")
        time.sleep(TIMEOUT * 1.5)  # the head is whole: the body may take its time
        s.sendall(body)
        first = _response(s)
        assert first.startswith(b"HTTP/1.1 200") and first.endswith(b'{"n":10}')
        s.sendall(_request(b"yy"))  # the same connection, kept alive
        assert _response(s).endswith(b'{"n":2}')
        s.sendall(b"POST /echo HTTP/1.1\r\n")  # the next head, never finished
        assert _closed_after(s) < TIMEOUT + 5


def test_serve_and_the_background_server_use_it():
    import inspect

    from tracer.commands import serve

    assert HEADER_TIMEOUT_S <= 10 and HeaderTimeoutH11Protocol.header_timeout == HEADER_TIMEOUT_S
    assert "http=HeaderTimeoutH11Protocol" in inspect.getsource(serve._start_and_serve)
