"""The FastAPI app: ``build_app(engine_client, served_model_name, ...)`` over an ``EngineClient``
(``engine/engine/protocol.py``; its implementation: ``AsyncLLM``, the core in its own process or in this one).

Routes live in ``engine.entrypoints.openai.routers``, one module per concern, and reach shared state
through ``Depends(get_state)`` (``app.state.server``). Adding a router is one line::

    app = build_app(engine_client, "tiny-gpt2", api_key=key, host=host)
    app.state.trace = session                       # what the trace routes read
    app.include_router(trace_router)                # its control routes use Depends(require_control)

``require_control`` (engine.entrypoints.openai.security) guards endpoints that change the engine's course:
the API key when one is set, otherwise loopback-only.
"""
from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import FastAPI

from engine.engine.protocol import EngineClient
from engine.entrypoints.openai.chat_template import DEFAULT_CHAT_TEMPLATE
from engine.entrypoints.openai.errors import RefuseLargeBodies, install_error_handlers
from engine.entrypoints.openai.metrics import ServerMetrics
from engine.entrypoints.openai.routers import completions, health, metrics, models, prefix_cache, profile, tokenize
from engine.entrypoints.openai.routers.health import package_version
from engine.entrypoints.openai.state import ServerState
from engine.renderers.online_renderer import OnlineRenderer

# 1 MiB, as nginx's default: a GPT-2 family context (1,024 tokens) is some 5 KB as text or as
# token ids, and a body is parsed whole on the event loop before anything can refuse it
# (measured: a 3 MB JSON list of token ids takes ~100 ms to parse, 4 MiB of text ~20 ms).
DEFAULT_MAX_BODY_SIZE = 2 ** 20
ROUTERS = [completions.router, models.router, health.router, tokenize.router, metrics.router, prefix_cache.router,
           profile.router]


def build_app(engine_client: EngineClient, served_model_name: str, api_key: str | None = None, *,
              host: str = "127.0.0.1", chat_template: str | None = None, shutdown_engine: bool = True,
              max_body_size: int | None = DEFAULT_MAX_BODY_SIZE) -> FastAPI:
    """An OpenAI-compatible app serving `engine_client` as `served_model_name`.

    The engine loop starts with the app (lifespan) and, with shutdown_engine, stops with it:
    in-flight requests get the engine's drain_timeout to finish. `host` is the address the
    server binds; it decides whether trace control is open without a key. `chat_template`
    is Jinja source (see engine.entrypoints.openai.chat_template; default: DEFAULT_CHAT_TEMPLATE).
    A request body over `max_body_size` bytes is refused (413) as it arrives (None: no limit).
    """
    renderer = OnlineRenderer(engine_client.tokenizer, engine_client.max_model_len, engine_client.hooks)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine_client.start()
        yield
        if shutdown_engine:
            await engine_client.shutdown()
        renderer.close()

    app = FastAPI(title="vllm-trace", version=package_version(), lifespan=lifespan,
                  description="OpenAI-compatible serving of a traced paged-attention engine.")
    app.state.server = ServerState(engine=engine_client, model_name=served_model_name,
                                   chat_template=chat_template or DEFAULT_CHAT_TEMPLATE, api_key=api_key, host=host,
                                   metrics=ServerMetrics(engine_client, served_model_name), renderer=renderer)
    install_error_handlers(app)
    if max_body_size is not None:
        app.add_middleware(RefuseLargeBodies, max_body_size=max_body_size)
    for router in ROUTERS:
        app.include_router(router)
    return app
