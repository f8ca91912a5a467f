"""The HTTP servers' listening sockets (``serve``, ``proxy``, the lessons' background server).

asyncio turns Nagle's algorithm off (TCP_NODELAY) on each connection it accepts, but only where the
socket's protocol says TCP: ``socket.socket(AF_INET, SOCK_STREAM)`` leaves it 0, and so does every
connection accepted from it. With Nagle on, a stream's small SSE chunks after the response headers
waited for the client's delayed ACK: on a kept-alive connection (``vllm bench serve``'s aiohttp) every
chunk of a 16-token completion arrived at once, 44-48 ms after the request, instead of one a step
(time to first token at one stream: 47 ms against vLLM's 9 ms; a fresh connection, as curl's, did not
show it). vLLM's server gets the option from uvloop.
"""
from __future__ import annotations

import socket


def tcp_socket(family: int = socket.AF_INET) -> socket.socket:
    """A TCP socket to listen on whose accepted connections asyncio sets TCP_NODELAY on."""
    return socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
