"""`vllm-trace serve MODEL`: the engine behind an OpenAI-compatible HTTP server, traced.

Startup prints each stage with its time as it finishes and traces it as a span: args (flags,
port), config (the engine config), the engine's own stages (model, tokenizer, weights, KV
cache), kernel_warmup (one dummy forward, no request, no step), http_ready; then a ready line
with the URL and commands to paste. The stages before the trace could exist are published with
their real times (the trace's clock starts when the command does).

The front end is engine.engine.async_llm.AsyncLLM, the server's EngineClient. Its engine core
runs in its own process (as vLLM V1) unless --no-multiprocessing (or
VLLM_TRACE_ENABLE_MULTIPROCESSING=0) keeps it in this one, stepped on a thread; in its own
process, its startup stages arrive over the process boundary live, after core_process_start,
and core_handshake ends when it is ready. If the core dies, requests in flight fail, new ones get 503, and serve
exits with status 1 after saying why.

The trace session (on unless --no-trace) feeds /trace (tracer.trace_api), --trace-file and
--trace-log. Ctrl-C (or SIGTERM) stops accepting connections, ends /trace/events streams, lets
a held engine run free, gives in-flight requests --drain-timeout seconds, stops the engine, and
only then closes the trace file, so the file ends with those requests' last events.

In order: run() checks the flags, binds the port and configures the engine and the trace
session; _start_and_serve() starts the front end (start_front_end), configures the app and
uvicorn (_configure_app), serves until stopped (DrainingServer in tracer.commands.serve_http,
which owns the drain; _run_until_stopped), and reports how it ended (_report).

The drain never cuts a response silently: at the deadline the engine ends every request still
running with "the server shut down before this request finished", which a stream sends as an
error event and ``data: [DONE]`` (a non-streamed request: a 503), and uvicorn's own timeout,
which would close the connections with nothing said, comes DRAIN_GRACE seconds later. A second
Ctrl-C or SIGTERM aborts them at once. The exit line says how many were cut.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
import time

from engine.arg_utils import EngineArgs
from engine.entrypoints.sockets import tcp_socket
from tracer.commands import model_help
from tracer.errors import UserError

DRAIN_GRACE = 5.0  # s after the drain deadline: the cut responses send their error event and [DONE]

DESCRIPTION = """\
Serve MODEL over HTTP with OpenAI's API: POST /v1/completions, POST /v1/chat/completions
(stream: true for server-sent events), GET /v1/models, plus /health, /version, /tokenize,
/detokenize and Prometheus /metrics. Every request runs through the traced engine, under the
same id (cmpl-... / chatcmpl-...) the trace shows.

Try it from a second terminal with `vllm-trace send "Hello"` or `vllm-trace bench`.
"""


DEATH_GRACE_S = 2.0  # after the engine core died: seconds /health and new requests still answer 503


def register(sub) -> None:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help=model_help())
    h = p.add_argument_group("http server")
    h.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1; 0.0.0.0 exposes it to the network, where trace "
                        "control then needs --api-key)")
    h.add_argument("--port", type=port_number, default=8000, help="port (default 8000; 0 picks a free one)")
    h.add_argument("--served-model-name", default=None,
                   help="the name clients pass as `model` and /v1/models lists (default: MODEL)")
    h.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* and on trace control endpoints")
    h.add_argument("--chat-template", metavar="FILE", default=None,
                   help="Jinja chat template, as transformers uses (default: the tokenizer's own, else a plain "
                        "'Role: content' transcript; see engine/entrypoints/openai/chat_template.py)")
    h.add_argument("--drain-timeout", type=float, default=5.0,
                   help="on Ctrl-C or SIGTERM, seconds in-flight requests get to finish; then each ends with an "
                        "error (a stream: an error event and [DONE]). Again: abort them now (default 5)")
    h.add_argument("--max-request-body-mib", type=float, default=1.0, metavar="MIB",
                   help="refuse larger request bodies with 413 as they arrive (default 1 MiB; a whole GPT-2 "
                        "context is some 5 KB of text)")
    h.add_argument("--uvicorn-log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="uvicorn's log level; 'info' logs every request (default warning)")
    tr = p.add_argument_group("tracing", "the event stream, /trace control and recording (docs/user-guide.md)")
    tr.add_argument("--trace-file", metavar="PATH", default=None,
                    help="record every event as JSON lines (valid after Ctrl-C; `vllm-trace export PATH` for Perfetto)")
    tr.add_argument("--start-paused", action="store_true",
                    help="hold the engine before its first step; drive it with POST /trace/step or /trace/resume")
    tr.add_argument("--trace-log", action="store_true",
                    help="print events as readable '[TRACE] layer name key=value' lines on stderr")
    tr.add_argument("--trace-log-layers", metavar="A,B", default=None,
                    help="only these layers in --trace-log (implies it), e.g. scheduler,block_manager")
    tr.add_argument("--no-trace", action="store_true",
                    help="no tracer at all (engine hooks cost nothing; /trace answers 503)")
    p.add_argument("--no-multiprocessing", action="store_true",
                   default=os.environ.get("VLLM_TRACE_ENABLE_MULTIPROCESSING", "1") == "0",
                   help="run the engine core in this process, not its own (default: its own process, as vLLM V1; "
                        "also VLLM_TRACE_ENABLE_MULTIPROCESSING=0)")
    tr.add_argument("--trace-max-finished", type=int, default=None, metavar="N",
                    help="finished requests /trace/state and the TUI keep, the oldest dropped first (default "
                         "256; the --trace-file keeps them all): a server's trace state stays small at any age")
    t = p.add_argument_group("display")
    t.add_argument("--no-tui", action="store_true",
                   help="headless: print startup and logs only (default: the TUI, from the first startup "
                        "stage on, when run in a terminal; `vllm-trace attach` opens it on a headless server)")
    t.add_argument("--web-port", type=port_number, default=None, metavar="PORT",
                   help="also serve the TUI in a browser on http://127.0.0.1:PORT (textual-serve; each tab runs "
                        "its own `vllm-trace attach`), with or without the terminal TUI")
    EngineArgs.add_cli_args(p)
    p.set_defaults(handler=run)


def port_number(text: str) -> int:
    """argparse type: a TCP port, 0-65535 (0: any free port)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port {port} is out of range (0-65535)")
    return port


def _fmt_details(stage: str, d: dict) -> str:
    if stage == "model_load" and "params" in d:
        threads = f"; {d['threads']}" if d.get("threads") else ""
        return f"{d['params']:,} parameters, {d['bytes'] / 2**20:.1f} MiB{threads}"
    if stage == "kv_cache_alloc" and "num_blocks" in d:
        return f"{d['num_blocks']} blocks x {d['block_size']} tokens, {d['bytes'] / 2**20:.1f} MiB ({d['reason']})"
    if stage == "tokenizer_load" and "vocab_size" in d:
        return f"vocab {d['vocab_size']}"
    if stage == "core_process_start" and "pid" in d:
        return f"engine core pid {d['pid']}"
    if stage == "core_handshake" and "num_blocks" in d:
        return f"ready: {d['num_blocks']} blocks x {d['block_size']} tokens, max_model_len {d['max_model_len']}"
    if stage == "kernel_warmup" and "kernels" in d:
        return f"{d['backend']}: {d['num_launches']} launches of {', '.join(d['kernels'])}, {d['num_tokens']} tokens"
    return " ".join(f"{k}={v}" for k, v in d.items() if k not in ("seconds", "ok", "pid"))


_SHOW_STAGES = True  # off while the TUI owns the terminal: its Startup panel shows them


def _stage(name: str, seconds: float, details: str = "") -> None:
    """One startup stage's line, in the Startup panel's words (its trace name: tracer.tui.fmt)."""
    from tracer.tui.fmt import STAGE_WIDTH, stage_label

    if not _SHOW_STAGES:
        return
    print(f"  {stage_label(name):<{STAGE_WIDTH}} {seconds * 1000:8.1f} ms  {details}", file=sys.stderr, flush=True)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = tcp_socket(family)  # (TCP_NODELAY on every connection: see engine/entrypoints/sockets.py)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise UserError(f"cannot listen on {host}:{port}: {e.strerror} (another server running? try --port)") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


_rank_lines: dict[str, list[tuple[int, str]]] = {}  # a stage's per-rank lines, printed under the engine's line for it


def _print_stage(layer, name, kind, request_id, step, attrs) -> None:
    from engine.hooks import END
    from engine.trace_names import CORE_HANDSHAKE, CORE_PROCESS_START, ENGINE, WORKER

    if kind == END and layer == WORKER and "rank" in attrs and "seconds" in attrs:
        # the workers finish first: their lines wait for the engine's, which says what they add up to
        from tracer.tui.fmt import STAGE_WIDTH, shard_details
        rank = f"  rank {attrs['rank']}"
        _rank_lines.setdefault(name, []).append((attrs["rank"], (
            f"  {rank:<{STAGE_WIDTH}} {attrs['seconds'] * 1000:8.1f} ms  {shard_details(name, attrs)}")))
    elif kind == END and "seconds" in attrs and (layer == ENGINE or name in (CORE_PROCESS_START, CORE_HANDSHAKE)):
        _stage(name, attrs["seconds"], _fmt_details(name, attrs))
        for _, line in sorted(_rank_lines.pop(name, [])) if layer == ENGINE else ():
            if _SHOW_STAGES:
                print(line, file=sys.stderr, flush=True)


async def start_front_end(args, config, hooks, session, on_dead, core_proc=None):
    """The AsyncLLM, ready: its core in its own process (core_proc: spawned early, see run) or, with
    --no-multiprocessing, built here on a thread (the loop, and the TUI, keep running). Its stages
    are printed live. A core process that cannot start is one line (UserError), not a hang."""
    from engine.engine.async_llm import AsyncLLM
    from engine.engine.core_client import EngineStartupError

    mp = not args.no_multiprocessing
    options = session.core_options() if session is not None else {"trace": True}  # stages: shipped during startup
    async_llm = AsyncLLM(config, hooks, drain_timeout=args.drain_timeout, core_options=options if mp else None,
                         on_dead=on_dead, core_proc=core_proc, multiprocess=mp)
    unsubscribe = hooks.subscribe(_print_stage)
    try:
        async_llm.launch()  # on this (the main) thread: the core's parent-death signal follows the launching thread
        await asyncio.to_thread(async_llm.wait_ready)
    except EngineStartupError as e:
        raise UserError(f"the engine core failed to start: {e}") from None
    finally:
        unsubscribe()  # without a tracer, hooks.active costs nothing from here on
    if session is None:
        async_llm.engine_core.call("trace", False)  # nobody listens: an untraced core ships nothing
    else:
        session.bind(async_llm)
    return async_llm


def _cli_span(bus, name: str, begin_ns: int, end_ns: int, **attrs) -> None:
    """Trace a startup stage timed before the trace existed, at its real times."""
    from engine.hooks import BEGIN, END

    bus.publish("cli", name, BEGIN, at_ns=begin_ns)
    bus.publish("cli", name, END, attrs={"seconds": (end_ns - begin_ns) / 1e9, **attrs}, at_ns=end_ns)


def _config_summary(config) -> str:
    c, s = config.cache, config.scheduler
    return (f"block_size={c.block_size} max_num_seqs={s.max_num_seqs} "
            f"max_num_batched_tokens={s.max_num_batched_tokens} prefix_caching={c.enable_prefix_caching}")


def run(args: argparse.Namespace) -> int:
    from engine.engine.core_client import spawn_core_process
    from engine.hooks import Hooks
    from tracer.tracelog import check_layers

    t0 = time.perf_counter_ns()
    if args.no_trace and (args.trace_file or args.start_paused or args.trace_log or args.trace_log_layers):
        raise ValueError("--no-trace cannot be combined with --trace-file, --start-paused or --trace-log")
    if args.no_trace and not args.no_tui:
        raise ValueError("--no-trace turns the tracer off, and the TUI is its view: add --no-tui")
    if args.trace_max_finished is not None and args.trace_max_finished < 1:
        raise ValueError(f"--trace-max-finished must be >= 1, got {args.trace_max_finished}")
    if not args.max_request_body_mib > 0:
        raise ValueError(f"--max-request-body-mib must be > 0, got {args.max_request_body_mib}")
    if not args.drain_timeout >= 0:
        raise ValueError(f"--drain-timeout must be >= 0, got {args.drain_timeout}")
    if not args.no_tui and not (sys.stdin.isatty() and sys.stdout.isatty() and sys.stderr.isatty()):
        print("vllm-trace serve: no terminal to draw the TUI in (stdin, stdout or stderr is not a TTY): "
              "running headless, as with --no-tui (`vllm-trace attach` opens the TUI)", file=sys.stderr)
        args.no_tui = True
    global _SHOW_STAGES
    _SHOW_STAGES = args.no_tui
    # a line at once: Textual and the TUI's widgets take a few seconds to import on a busy machine
    # (the TUI imports no torch: that is the engine core's), and a blank terminal reads as a hang
    print(f"vllm-trace serve {args.model}" + ("" if args.no_tui else ": opening the TUI…"), file=sys.stderr,
          flush=True)
    layers = check_layers(args.trace_log_layers.split(",")) if args.trace_log_layers else None
    sock = _bind(args.host, args.port)  # before loading anything: a busy port fails fast
    # The engine core starts now and imports torch and the engine while this process does the same
    # (engine.llm below): on 2 cores, serve is ready ~2.5 s sooner than starting it after them.
    core_proc = None if args.no_multiprocessing else spawn_core_process()
    t_args = time.perf_counter_ns()
    _stage("args", (t_args - t0) / 1e9, f"{args.host}:{sock.getsockname()[1]}")
    session = None
    try:
        config = EngineArgs.from_cli_args(args).create_engine_config()  # a bad value: ConfigError, one line
        t_config = time.perf_counter_ns()
        _stage("config", (t_config - t_args) / 1e9, _config_summary(config))
        hooks = Hooks()
        if not args.no_trace:
            from tracer.session import TraceSession
            session = TraceSession(hooks, trace_file=args.trace_file, trace_log=args.trace_log or bool(layers),
                                   layers=layers, start_paused=args.start_paused, model=args.model,
                                   engine_config=config.to_dict(), start_ns=t0,
                                   remote_control=not args.no_multiprocessing)
            if args.trace_max_finished is not None:
                session.state.max_finished = args.trace_max_finished
            session.state.follow()  # /trace/state answers at once, however long nobody read it
            _cli_span(session.bus, "args", t0, t_args, host=args.host, port=sock.getsockname()[1])
            _cli_span(session.bus, "config", t_args, t_config, config=config.to_dict())
        return asyncio.run(_serve(args, sock, config, hooks, session, core_proc))
    finally:
        sock.close()
        if core_proc is not None and not core_proc.stdin.closed:  # never launched (an error before it)
            core_proc.kill()
            core_proc.wait()
        if session is not None:
            session.state.stop_following()
            session.close()  # after the engine stopped: the file ends with the drained requests


async def _serve(args: argparse.Namespace, sock: socket.socket, config, hooks, session, core_proc=None) -> int:
    name = args.served_model_name or args.model
    tui = None
    if not args.no_tui:  # first, so its Startup panel shows the stages below as they run
        from tracer.tui.serve import LiveTui
        tui = LiveTui(session, name, _url(args.host, sock.getsockname()[1]), args.api_key)
    try:
        return await _start_and_serve(args, sock, config, hooks, session, name, tui, core_proc)
    except BaseException:
        if tui is not None:
            await tui.close()  # the terminal back before the error is printed
        raise


async def _start_and_serve(args, sock, config, hooks, session, name: str, tui, core_proc=None) -> int:
    """Start the front end, configure the app and uvicorn, serve until Ctrl-C (with the drain) or
    the core's death, then report how it ended (the exit status)."""
    import uvicorn

    from engine.entrypoints.openai.http_protocol import HeaderTimeoutH11Protocol
    from engine.hooks import BEGIN, END
    from tracer.commands.serve_http import DrainingServer

    died: list[str] = []  # why the engine core died, if it did (set on its monitor thread)
    stop_server: list = []  # the uvicorn server, once it exists
    loop = asyncio.get_running_loop()

    def on_dead(reason: str) -> None:
        died.append(reason)
        loop.call_soon_threadsafe(_stop_after_death, reason, stop_server)

    engine = await start_front_end(args, config, hooks, session, on_dead, core_proc)
    if tui is not None and tui.quit:
        await asyncio.to_thread(engine.stop, 0)
        await tui.close()
        print("vllm-trace serve: quit before the server started", file=sys.stderr)
        return 0
    app = _configure_app(args, engine, name, session, tui)
    uv_config = uvicorn.Config(app, log_level=args.uvicorn_log_level, lifespan="on",
                               timeout_graceful_shutdown=args.drain_timeout + DRAIN_GRACE,
                               http=HeaderTimeoutH11Protocol)  # a request's head within 10 s, or closed
    server = DrainingServer(uv_config, engine, session, args.drain_timeout, died)
    stop_server.append(server)
    t_http = time.perf_counter()
    if hooks.active:
        hooks.emit("cli", "http_ready", BEGIN, host=args.host, port=sock.getsockname()[1])
    serving = await server.start(sock)
    if not server.ready.is_set():  # uvicorn did not start (its own error is on stderr)
        if tui is not None:
            await tui.close()
        await serving
        return 1
    url = _announce(args, hooks, name, sock, time.perf_counter() - t_http, session)
    await _run_until_stopped(args, url, serving, server, tui)
    if hooks.active:
        hooks.emit("cli", "serve", END)
    return _report(args, app.state.server.num_cut_at_shutdown, server.force_exit, died)


def _configure_app(args, engine, name: str, session, tui):
    """The OpenAI app over the engine, with the /trace routes (503 with --no-trace); the TUI gets the engine."""
    from engine.entrypoints.openai import build_app
    from engine.entrypoints.openai.chat_template import load_chat_template
    from tracer import trace_api

    template = load_chat_template(args.chat_template, engine.tokenizer)
    if tui is not None:
        tui.engine_ready(engine)
    app = build_app(engine, name, args.api_key, host=args.host, chat_template=template,
                    max_body_size=int(args.max_request_body_mib * 2 ** 20))
    app.state.trace = session  # None with --no-trace: /trace answers 503
    app.include_router(trace_api.router)
    return app


def _announce(args, hooks, name: str, sock, http_seconds: float, session) -> str:
    """uvicorn is up: the http_ready stage, the serve span's start, the ready banner; the URL."""
    from engine.entrypoints.openai.security import control_refusal
    from engine.gc_utils import freeze_gc_heap, raise_young_threshold
    from engine.hooks import BEGIN, END

    url = _url(args.host, sock.getsockname()[1])
    _stage("http_ready", http_seconds, f"{url} (uvicorn + engine loop)")
    if hooks.active:
        hooks.emit("cli", "http_ready", END, seconds=http_seconds, url=url)
        hooks.emit("cli", "serve", BEGIN, model=args.model, served_model_name=name, host=args.host,
                   port=sock.getsockname()[1], url=url)
    _banner(args, name, url, control_refusal(args.host, args.api_key), session)
    freeze_gc_heap()  # the front end's startup heap (FastAPI, Textual): see engine.gc_utils
    raise_young_threshold()  # it decodes and folds every event: see engine.gc_utils
    return url


async def _run_until_stopped(args, url: str, serving: asyncio.Task, server, tui) -> None:
    """Serve (with the TUI, and the browser view with --web-port) until uvicorn has stopped."""
    web = None
    if args.web_port is not None:
        from tracer.tui.web import WebView
        web = await WebView(url, args.web_port, args.api_key).start()
        if tui is None:
            print(f"  browser view: {web.url} (the TUI, one `vllm-trace attach` per tab)", file=sys.stderr)
        else:
            tui.app.notify(f"browser view: {web.url}", timeout=15)
    try:
        if tui is None:
            await serving
        else:
            await tui.run(server, serving)
    finally:
        if web is not None:
            await web.stop()
    if tui is not None:
        print(tui.summary(args.trace_file), file=sys.stderr)


def _report(args, cut: int, forced: bool, died: list[str]) -> int:
    """How serve ended, in one line; the exit status (1: the engine core died)."""
    if died:
        print(f"vllm-trace serve: stopped because the {died[0]}", file=sys.stderr)
        return 1
    if forced:
        print(f"vllm-trace serve: stopped at a second Ctrl-C or SIGTERM; {cut} response(s) in flight were "
              f"aborted, each ended with an error", file=sys.stderr)
    elif cut:
        print(f"vllm-trace serve: stopped; {cut} response(s) still running at the --drain-timeout deadline "
              f"({args.drain_timeout:g} s) were ended with an error (server shutting down)", file=sys.stderr)
    else:
        print("vllm-trace serve: stopped cleanly (every request finished)", file=sys.stderr)
    return 0


def _stop_after_death(reason: str, server: list) -> None:
    """The core is gone: say so, keep answering 503 (new requests, /health) for a moment so
    clients see why, then stop the server; serve then exits with status 1."""
    print(f"vllm-trace serve: {reason}; in-flight requests failed, stopping the server", file=sys.stderr, flush=True)
    if server:
        asyncio.get_running_loop().call_later(DEATH_GRACE_S, setattr, server[0], "should_exit", True)


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _banner(args: argparse.Namespace, name: str, url: str, refusal: str | None, session) -> None:
    from tracer.defaults import DEFAULT_PROMPT, sample_body

    body = json.dumps(sample_body(name))
    auth = f" -H 'Authorization: Bearer {args.api_key}'" if args.api_key else ""
    print(f"\nReady: {name} at {url} (OpenAI API under {url}/v1; Ctrl-C to stop)", file=sys.stderr)
    print(f"  curl {url}/v1/completions -H 'Content-Type: application/json'{auth} -d '{body}'", file=sys.stderr)
    print(f"  vllm-trace send --url {url} \"{DEFAULT_PROMPT}\"", file=sys.stderr)
    if session is None:
        print("  tracing: off (--no-trace)", file=sys.stderr)
    else:
        print(f"  trace: curl {url}/trace/state{auth}   curl -N {url}/trace/events{auth}", file=sys.stderr)
        if args.trace_file:
            print(f"  recording to {args.trace_file} (then: vllm-trace export {args.trace_file} -o trace.json)",
                  file=sys.stderr)
        if refusal:
            print(f"  note: {refusal}", file=sys.stderr)
        elif args.start_paused:
            print(f"  engine held before its first step: curl -X POST {url}/trace/step{auth} "
                  f"-H 'Content-Type: application/json' -d '{{}}' (or /trace/resume)", file=sys.stderr)
    sys.stderr.flush()
