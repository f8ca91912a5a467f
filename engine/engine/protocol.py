"""EngineClient: what the serving layer and the TUI need of an engine (vLLM's ``engine/protocol.py``).

The OpenAI server (``engine.entrypoints.openai``), ``serve`` and the TUI are typed against this
class, never against its one implementation, ``AsyncLLM`` (``engine/engine/async_llm.py``), which
serves the engine core in its own process or in this one. vLLM's protocol has more (LoRA,
pooling, sleep, weight updates); this one has what our server uses, plus what the tracer drives
(``is_parked``, ``step_listeners``, ``held_attention_on_triton``). Two differences, both because a
drain blocks: ``shutdown`` is a coroutine (vLLM's is a plain call) and takes the drain's timeout,
``stop`` is its blocking twin; ``abort`` is a plain call (a stream's ``finally`` makes it).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING, AsyncIterator, Callable

if TYPE_CHECKING:
    from engine.engine.output_processor import RequestStream
    from engine.hooks import Hooks
    from engine.outputs import EngineStats, RequestOutput
    from engine.sampling_params import SamplingParams

# listener(outputs of one step, stats after it, ids the core aborted since the last call)
StepListener = Callable[["list[RequestOutput]", "EngineStats", "list[str]"], None]


class EngineClient(ABC):
    """Protocol class for clients to the engine (see the module docstring)."""

    hooks: Hooks
    tokenizer: object
    model_path: Path | str
    max_model_len: int
    device: str
    attention_backend: str
    stats: EngineStats  # after the latest step (or accepted request)
    step_listeners: list[StepListener]  # called after every step, off the event loop
    drain_timeout: float  # shutdown(): how long in-flight requests may finish

    @property
    @abstractmethod
    def is_running(self) -> bool: ...

    @property
    @abstractmethod
    def is_parked(self) -> bool:
        """True while a step controller holds the engine inside a step."""

    @property
    @abstractmethod
    def step_count(self) -> int: ...

    @abstractmethod
    def start(self) -> EngineClient:
        """Start the engine core if not started yet (blocks until it is ready)."""

    @abstractmethod
    async def add_request(self, request_id: str, prompt, params: SamplingParams, priority: int = 0) -> RequestStream:
        """Queue a request; returns once the core has it. ValueError: refused, nothing queued."""

    @abstractmethod
    def generate(self, prompt, params: SamplingParams, request_id: str,
                 priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Outputs (cumulative) of one request until it finishes."""

    @abstractmethod
    def abort(self, request_id: str) -> None:
        """Stop a request; unknown ids: no-op."""

    @abstractmethod
    async def check_health(self) -> None:
        """Raise EngineDeadError unless the engine is alive and answering."""

    @abstractmethod
    async def start_profile(self) -> dict: ...

    @abstractmethod
    async def stop_profile(self) -> dict: ...

    @abstractmethod
    async def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache; False while requests hold blocks."""

    @abstractmethod
    def held_attention_on_triton(self) -> dict:
        """Re-run the attention launch the engine is held before through Triton (blocks)."""

    @abstractmethod
    async def shutdown(self, drain_timeout: float | None = None) -> None:
        """Stop taking requests, let in-flight ones finish for up to drain_timeout seconds, stop the core."""

    @abstractmethod
    def stop(self, drain_timeout: float | None = None) -> None:
        """shutdown(), blocking."""
