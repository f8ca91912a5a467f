"""The HTTP servers' sockets turn Nagle's algorithm off on every connection (engine/entrypoints/sockets.py):
asyncio sets TCP_NODELAY only on connections accepted from a socket whose protocol says TCP. Without it a
kept-alive stream's SSE chunks waited for the client's delayed ACK and arrived all at once."""
import asyncio
import socket

import httpx
from fastapi import FastAPI

from engine.entrypoints.openai.background import start_background
from engine.entrypoints.sockets import tcp_socket
from tracer.commands.proxy import _listen
from tracer.commands.serve import _bind


def _nodelay_of_accepted(listener: socket.socket) -> int:
    async def run() -> int:
        seen: asyncio.Future = asyncio.get_running_loop().create_future()

        async def on_connect(reader, writer):
            sock = writer.get_extra_info("socket")
            seen.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(on_connect, sock=listener)
        _, writer = await asyncio.open_connection(*listener.getsockname()[:2])
        try:
            return await asyncio.wait_for(seen, 10)
        finally:
            writer.close()
            server.close()
    return asyncio.run(run())


def test_connections_accepted_by_a_tcp_socket_have_nagle_off():
    listener = tcp_socket()
    listener.bind(("127.0.0.1", 0))
    assert _nodelay_of_accepted(listener) == 1


def test_without_the_tcp_protocol_asyncio_leaves_nagle_on():  # what the servers did before
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    assert _nodelay_of_accepted(listener) == 0


def test_serve_and_proxy_listen_on_tcp_sockets():
    for sock in (_bind("127.0.0.1", 0), _listen("127.0.0.1", 0)):
        with sock:
            assert sock.proto == socket.IPPROTO_TCP, sock


def test_the_background_server_answers_on_its_tcp_socket():
    app = FastAPI()
    app.get("/ping")(lambda: {"ok": True})
    server, thread, url = start_background(app)
    try:
        assert httpx.get(url + "/ping", timeout=10).json() == {"ok": True}
        assert all(s.proto == socket.IPPROTO_TCP for srv in server.servers for s in srv.sockets)
    finally:
        server.should_exit = True
        thread.join(10)
