"""One request's structured output state (vLLM V1's ``v1/structured_output/request.py``)."""
from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

from engine.sampling_params import StructuredOutputsParams


@dataclass
class StructuredOutputRequest:
    """The request's grammar: compiling (a Future of the compiled grammar, shared by every request
    with the same key), then its own matcher (``grammar``), or the error that stopped it."""
    params: StructuredOutputsParams
    compiled: Future | None = None
    grammar: object | None = None  # an XgrammarGrammar once the compile finished
    error: str | None = None
    cache_hit: bool = False  # the compiled grammar was there already (another request's)
    compile_s: float = 0.0  # how long compiling took (on the compile thread)
    queued_at: float = 0.0  # time.monotonic() when it was handed to the compile thread
    # per generated token: how many tokens the mask allowed when it was sampled
    num_allowed: list[int] = field(default_factory=list)

    @property
    def key(self) -> tuple:
        return self.params.key

    @property
    def kind(self) -> str:
        return self.params.kind
