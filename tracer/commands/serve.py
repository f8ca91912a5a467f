"""`vllm-trace serve MODEL`: the engine behind an OpenAI-compatible HTTP server.

Startup prints each stage with its time as it finishes (args, config, the engine's own
stages: model, tokenizer, weights, KV cache; then HTTP), then a ready line with the URL and a
curl command to paste. Ctrl-C stops accepting connections, gives in-flight requests
--drain-timeout seconds to finish, then aborts the rest and exits.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import time

from tracer.commands.engine_args import add_engine_args, llm_kwargs

DESCRIPTION = """\
Serve MODEL over HTTP with OpenAI's API: POST /v1/completions, POST /v1/chat/completions
(stream: true for server-sent events), GET /v1/models, plus /health, /version, /tokenize,
/detokenize and Prometheus /metrics. Every request runs through the traced engine, under the
same id (cmpl-... / chatcmpl-...) the trace shows.

Try it from a second terminal with `vllm-trace send "Hello"` or `vllm-trace bench`.
"""


def register(sub) -> None:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="tiny-gpt2 (built in, offline), a Hugging Face name such as gpt2, or a local directory")
    h = p.add_argument_group("http server")
    h.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1; 0.0.0.0 exposes it to the network, where trace "
                        "control then needs --api-key)")
    h.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    h.add_argument("--served-model-name", default=None,
                   help="the name clients pass as `model` and /v1/models lists (default: MODEL)")
    h.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* and on trace control endpoints")
    h.add_argument("--chat-template", metavar="FILE", default=None,
                   help="Jinja chat template, as transformers uses (default: the tokenizer's own, else a plain "
                        "'Role: content' transcript; see engine/server/chat_template.py)")
    h.add_argument("--drain-timeout", type=float, default=5.0,
                   help="on Ctrl-C, seconds in-flight requests get to finish before they are aborted (default 5)")
    h.add_argument("--uvicorn-log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="uvicorn's log level; 'info' logs every request (default warning)")
    t = p.add_argument_group("display")
    t.add_argument("--no-tui", action="store_true",
                   help="headless: print startup and logs only (default: the TUI, once HTTP is ready; "
                        "`vllm-trace attach` opens it on a headless server)")
    add_engine_args(p)
    p.set_defaults(handler=run)


def _fmt_details(stage: str, d: dict) -> str:
    if stage == "model_load" and "params" in d:
        return f"{d['params']:,} parameters, {d['bytes'] / 2**20:.1f} MiB"
    if stage == "kv_cache_alloc" and "num_blocks" in d:
        return f"{d['num_blocks']} blocks x {d['block_size']} tokens, {d['bytes'] / 2**20:.1f} MiB ({d['reason']})"
    if stage == "tokenizer_load" and "vocab_size" in d:
        return f"vocab {d['vocab_size']}"
    return " ".join(f"{k}={v}" for k, v in d.items() if k not in ("seconds", "ok"))


def _stage(name: str, seconds: float, details: str = "") -> None:
    print(f"  {name:<16} {seconds * 1000:8.1f} ms  {details}", file=sys.stderr, flush=True)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        from tracer.cli import UserError
        raise UserError(f"cannot listen on {host}:{port}: {e.strerror} (another server running? try --port)") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def build_engine(args: argparse.Namespace, hooks=None):
    """The engine, printing its stages live (a listener attached for startup only)."""
    from engine import LLM, Hooks
    from engine.hooks import END

    hooks = hooks or Hooks()

    def on_event(layer, name, kind, request_id, step, attrs) -> None:
        if layer == "engine" and kind == END and "seconds" in attrs:
            _stage(name, attrs["seconds"], _fmt_details(name, attrs))

    unsubscribe = hooks.subscribe(on_event)
    try:
        return LLM(args.model, hooks=hooks, **llm_kwargs(args)).llm_engine
    finally:
        unsubscribe()  # from here on hooks.active costs nothing until the tracer attaches


def run(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    print(f"vllm-trace serve {args.model}", file=sys.stderr)
    sock = _bind(args.host, args.port)  # before loading anything: a busy port fails fast
    _stage("args", time.perf_counter() - t0, f"{args.host}:{sock.getsockname()[1]}")
    try:
        return asyncio.run(_serve(args, sock))
    finally:
        sock.close()


async def _serve(args: argparse.Namespace, sock: socket.socket) -> int:
    import uvicorn

    from engine.async_engine import AsyncLLMEngine
    from engine.hooks import BEGIN, END
    from engine.server import build_app
    from engine.server.chat_template import load_chat_template
    from engine.server.security import control_refusal

    tui_session = None
    if not args.no_tui:  # the TUI's tracer, attached before the engine so its startup is traced
        from engine import Hooks
        from tracer.session import TraceSession
        tui_session = TraceSession(Hooks(), model=args.model)
    engine = build_engine(args, tui_session and tui_session.hooks)
    name = args.served_model_name or args.model
    template = load_chat_template(args.chat_template, engine.tokenizer)
    async_engine = AsyncLLMEngine(engine, drain_timeout=args.drain_timeout)
    app = build_app(async_engine, name, args.api_key, host=args.host, chat_template=template)
    hooks = engine.hooks

    ready = asyncio.Event()
    t_http = time.perf_counter()

    class Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if self.started:
                ready.set()

        async def shutdown(self, sockets=None) -> None:
            await super().shutdown(sockets)
            # uvicorn re-raises a caught Ctrl-C once it has shut down (exit 130 with a
            # KeyboardInterrupt); ours was handled, requests drained: exit 0 instead
            self._captured_signals.clear()

    config = uvicorn.Config(app, log_level=args.uvicorn_log_level, timeout_graceful_shutdown=args.drain_timeout,
                            lifespan="on")
    server = Server(config)
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    waiter = asyncio.create_task(ready.wait())
    await asyncio.wait({serving, waiter}, return_when=asyncio.FIRST_COMPLETED)
    if not ready.is_set():
        waiter.cancel()
        await serving
        return 1
    _stage("http_ready", time.perf_counter() - t_http, "uvicorn + engine loop")
    if hooks.active: hooks.emit("cli", "serve", BEGIN, model=args.model, served_model_name=name, host=args.host, port=sock.getsockname()[1])
    _banner(args, name, sock.getsockname()[1], control_refusal(args.host, args.api_key))
    if tui_session is None:
        await serving
    else:
        from tracer.tui.serve import run_tui
        await run_tui(server, serving, tui_session, async_engine, name, _url(args.host, sock.getsockname()[1]),
                      args.api_key)
        tui_session.close()
    if hooks.active: hooks.emit("cli", "serve", END)
    print("vllm-trace serve: stopped cleanly", file=sys.stderr)
    return 0


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _banner(args: argparse.Namespace, name: str, port: int, refusal: str | None) -> None:
    url = _url(args.host, port)
    body = json.dumps({"model": name, "prompt": "Hello, my name is", "max_tokens": 16})
    auth = f" -H 'Authorization: Bearer {args.api_key}'" if args.api_key else ""
    print(f"\nReady: {name} at {url} (OpenAI API under {url}/v1; Ctrl-C to stop)", file=sys.stderr)
    print(f"  curl {url}/v1/completions -H 'Content-Type: application/json'{auth} -d '{body}'", file=sys.stderr)
    print(f"  vllm-trace send --url {url} \"Hello, my name is\"", file=sys.stderr)
    if refusal:
        print(f"  note: {refusal}", file=sys.stderr)
    sys.stderr.flush()
