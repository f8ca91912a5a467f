"""What every route needs, kept on ``app.state.server`` and injected with ``Depends``."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, Request

from engine.engine.protocol import EngineClient
from engine.entrypoints.openai.errors import APIError
from engine.hooks import Hooks
from engine.renderers.online_renderer import OnlineRenderer


@dataclass
class ServerState:
    engine: EngineClient
    model_name: str
    chat_template: str
    api_key: str | None = None
    host: str = "127.0.0.1"  # the address the server binds; decides whether control is open
    metrics: object | None = None  # engine.entrypoints.openai.metrics.ServerMetrics
    renderer: OnlineRenderer | None = None  # tokenizes off the engine's path (build_app makes it)
    num_cut_at_shutdown: int = 0  # responses that ended with "the server shut down" (the exit line says how many)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def hooks(self) -> Hooks:
        return self.engine.hooks

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist; this server serves `{self.model_name}`.",
                           param="model", code="model_not_found")


# The dependencies are `async def` although they never await: FastAPI runs a plain `def` one in
# its thread pool, two thread hops per request (~17 % of the API server's CPU per request, measured
# with py-spy under 64 streams).
async def get_state(request: Request) -> ServerState:
    return request.app.state.server


StateDep = Annotated[ServerState, Depends(get_state)]
