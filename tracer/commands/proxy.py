"""`vllm-trace proxy --prefill URL --decode URL`: disaggregated prefill and decode behind one
OpenAI-compatible front (vLLM's toy proxy, ``tests/v1/kv_connector/nixl_integration/toy_proxy_server.py``).

Each completion or chat completion goes first to a prefill instance (round robin) with
``max_tokens=1``, not streamed, and ``kv_transfer_params={"do_remote_decode": true}``: it computes
the prompt and keeps its KV blocks. Its answer's ``kv_transfer_params`` (where those blocks are)
then go with the original request to a decode instance, whose answer (streamed or not) is the
client's. Both instances run ``vllm-trace serve`` with ``--kv-transfer-config`` naming the
P2pZmqConnector (``kv_producer`` on the prefill side, ``kv_consumer`` on the decode side).

An instance that cannot be reached is a 503 naming it; one that fails mid-request a 502 (in a
stream: an error event, then ``[DONE]``); a request the instance refuses keeps that instance's status
and message. A request the prefill instance ends at its first token (EOS, a stop string) goes to the
decode instance without kv_transfer_params: it computes the prompt itself. The client's
Authorization header goes on to both instances (their --api-key). The client never waits on a dead
instance.
"""

import argparse
import itertools
import json
import socket
import sys

import httpx

from engine.entrypoints.sockets import tcp_socket
from tracer.commands import HelpFormatter
from tracer.errors import UserError
from tracer.net import trust_env

CONNECT_TIMEOUT_S = 5.0


def register(sub) -> None:
    p = sub.add_parser("proxy", help="one OpenAI endpoint over a prefill instance and a decode instance",
                       description="Serve /v1/completions and /v1/chat/completions by sending each request to a "
                                   "prefill instance (max_tokens=1, kv_transfer_params do_remote_decode), then to a "
                                   "decode instance with the KV blocks' whereabouts it answered. Start the instances "
                                   "with `vllm-trace serve --kv-transfer-config` (P2pZmqConnector).",
                       formatter_class=HelpFormatter)
    p.add_argument("--prefill", action="append", required=True, metavar="URL",
                   help="a prefill instance's base URL (repeat for several: round robin)")
    p.add_argument("--decode", action="append", required=True, metavar="URL",
                   help="a decode instance's base URL (repeat for several: round robin)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind")
    p.add_argument("--port", type=int, default=8100, help="port to bind (0: a free one)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds an instance may take to answer")
    p.set_defaults(handler=run)


class Upstream:
    """The instances, a client to reach them, and the two hops of a request."""

    def __init__(self, prefill: list[str], decode: list[str], timeout: float):
        self.prefill, self.decode = [u.rstrip("/") for u in prefill], [u.rstrip("/") for u in decode]
        self._next_prefill, self._next_decode = itertools.cycle(self.prefill), itertools.cycle(self.decode)
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=CONNECT_TIMEOUT_S),
                                        trust_env=all(trust_env(u) for u in self.prefill + self.decode))

    async def prefill_hop(self, path: str, body: dict, headers: dict) -> dict | None:
        """The prefill instance's kv_transfer_params for the request (raises ProxyError); None if it
        stopped at its first token (EOS, a stop string): the decode instance then computes the prompt."""
        url = next(self._next_prefill)
        req = dict(body, max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
        if "max_completion_tokens" in req:
            req["max_completion_tokens"] = 1
        req.pop("stream_options", None)
        req.pop("min_tokens", None)
        resp = await self._send(url, path, req, headers)
        if resp.status_code != 200:
            raise ProxyError(resp.status_code, _message(resp), upstream=True)
        answer = resp.json()
        params = answer.get("kv_transfer_params")
        if not params and answer["choices"][0].get("finish_reason") != "length":
            return None
        if not params:
            raise ProxyError(502, f"the prefill instance at {url} answered no kv_transfer_params: start it with "
                                  "--kv-transfer-config naming P2pZmqConnector (kv_role kv_producer)")
        return params

    def decode_url(self) -> str:
        return next(self._next_decode)

    async def _send(self, url: str, path: str, body: dict, headers: dict) -> httpx.Response:
        try:
            return await self.client.post(url + path, json=body, headers=headers)
        except httpx.ConnectError as e:
            raise ProxyError(503, f"the instance at {url} is down ({type(e).__name__}): start it, or proxy to "
                                  "another one") from None
        except httpx.HTTPError as e:
            raise ProxyError(502, f"the instance at {url} failed mid-request ({type(e).__name__}: {e})") from None


class ProxyError(Exception):
    def __init__(self, status: int, message: str, upstream: bool = False):
        super().__init__(message)
        self.status, self.message, self.upstream = status, message, upstream

    def body(self) -> dict:
        kind = "BadGateway" if self.status == 502 else "ServiceUnavailable" if self.status == 503 else "BadRequest"
        return {"error": {"message": self.message, "type": kind, "param": None, "code": self.status}}


def _message(resp: httpx.Response) -> str:
    try:
        return resp.json()["error"]["message"]
    except Exception:
        return resp.text.strip() or resp.reason_phrase


def build_app(upstream: Upstream):
    """The proxy's FastAPI app: the two OpenAI routes, /v1/models and /health."""
    # (imported here: the CLI loads every command's module to list it; no future annotations in this
    # module, so FastAPI sees the real Request class in the route signatures)
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse

    app = FastAPI(title="vllm-trace proxy")

    async def handle(request: Request, path: str):
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise ValueError("the body must be a JSON object")
        except ValueError as e:
            return JSONResponse(ProxyError(400, f"invalid JSON body: {e}").body(), status_code=400)
        # the instances' --api-key, if any: the client's key goes on to both
        headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
        try:
            params = await upstream.prefill_hop(path, body, headers)
            url = upstream.decode_url()
            body = dict(body, kv_transfer_params=params) if params else body
            if body.get("stream"):
                return StreamingResponse(_stream(upstream, url, path, body, headers), media_type="text/event-stream")
            resp = await upstream._send(url, path, body, headers)
        except ProxyError as e:
            return JSONResponse(e.body(), status_code=e.status)
        return Response(resp.content, status_code=resp.status_code, media_type="application/json")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request):
        headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
        try:
            resp = await upstream.client.get(upstream.decode[0] + "/v1/models", headers=headers)
        except httpx.HTTPError as e:
            err = ProxyError(503, f"the instance at {upstream.decode[0]} is down ({type(e).__name__})")
            return JSONResponse(err.body(), status_code=503)
        return Response(resp.content, status_code=resp.status_code, media_type="application/json")

    @app.get("/health")
    async def health():
        return {"prefill": upstream.prefill, "decode": upstream.decode}

    return app


async def _stream(upstream: Upstream, url: str, path: str, body: dict, headers: dict):
    """The decode instance's server-sent events as they come; if it fails, an error event and [DONE]."""
    try:
        async with upstream.client.stream("POST", url + path, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                await resp.aread()
                raise ProxyError(resp.status_code, _message(resp), upstream=True)
            async for chunk in resp.aiter_raw():
                yield chunk
    except httpx.ConnectError as e:
        yield _sse_error(ProxyError(503, f"the decode instance at {url} is down ({type(e).__name__})"))
    except httpx.HTTPError as e:
        yield _sse_error(ProxyError(502, f"the decode instance at {url} failed mid-request ({type(e).__name__})"))
    except ProxyError as e:
        yield _sse_error(e)


def _sse_error(e: ProxyError) -> bytes:
    return f"data: {json.dumps(e.body())}\n\ndata: [DONE]\n\n".encode()


def _listen(host: str, port: int) -> socket.socket:
    sock = tcp_socket()  # (TCP_NODELAY on every connection: see engine/entrypoints/sockets.py)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise UserError(f"cannot listen on {host}:{port} ({e.strerror}): choose another --port") from None
    return sock


def run(args: argparse.Namespace) -> int:
    import uvicorn

    sock = _listen(args.host, args.port)
    host, port = sock.getsockname()[:2]
    app = build_app(Upstream(args.prefill, args.decode, args.timeout))
    print(f"Ready: proxy at http://{host}:{port} (prefill: {', '.join(args.prefill)}; decode: "
          f"{', '.join(args.decode)})", file=sys.stderr, flush=True)
    try:
        uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn stops on Ctrl-C, then raises it again: a stop, not a failure
        pass
    print("proxy stopped", file=sys.stderr)
    return 0
