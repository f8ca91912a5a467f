"""What goes over the wire between the API-server process and the engine-core process.

msgspec Structs encoded as msgpack arrays (``array_like``: no field names on the wire), as
vLLM V1's ``v1/engine/__init__.py``. The front end sends each request as two frames:
``[EngineCoreRequestType, payload]``; the core answers with one ``EngineCoreOutputs`` per
message. Requests carry token ids, never text: tokenizing and detokenizing happen in the
API-server process.
"""
from __future__ import annotations

import enum
from typing import Any

import msgspec


class EngineCoreRequestType(enum.Enum):
    """The first frame of every message to the core."""
    ADD = b"\x00"
    ABORT = b"\x01"
    UTILITY = b"\x02"


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: dict[str, Any]  # SamplingParams' init fields
    arrival_time: float  # time.monotonic(): one clock for both processes on Linux
    prompt: str | None = None  # only to show in the trace and the TUI; the core never tokenizes
    priority: int = 0  # with scheduling_policy "priority": lower first


class EngineCoreAbort(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    request_ids: list[str]
    finish_reason: str = "abort"  # "stop": a stop string the output processor matched
    stop_reason: str | None = None


class UtilityCall(msgspec.Struct, array_like=True, gc=False):
    call_id: int  # 0: nobody waits for the answer
    method: str
    args: list[Any]


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One request's progress in one step: the tokens sampled since its last output."""
    request_id: str
    new_token_ids: list[int]
    # per new token: [[token id, logprob, rank, decoded token], ...] (the sampled one included)
    new_logprobs: list[list[list[Any]]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    metrics: dict[str, Any] | None = None  # on the first token and at the finish
    # with the first token, if asked: per prompt position 1..: [[token id, logprob, rank], ...], its own first
    new_prompt_logprobs: list[list[list[Any]]] | None = None
    kv_transfer_params: dict[str, Any] | None = None  # the KV connector's, with the last output

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Everything one message from the core says, applied by the front end in this order:
    trace events (so the events a step caused come before what the front end does with its
    outputs), then accepted / rejected adds, then outputs and aborts, then a utility answer."""
    # (layer, name, kind, request_id, step, attrs, perf_counter_ns), typed: a frame that is not the
    # core's fails to decode as a whole (and is skipped) rather than half-way through its handling
    events: list[tuple[str, str, str, Any, Any, dict | None, int]] = []
    accepted: list[str] = []  # now in the scheduler's waiting queue
    rejected: list[tuple[str, str]] = []  # (request id, the engine's error message)
    outputs: list[EngineCoreOutput] = []
    aborted: list[str] = []  # aborted in the core since its last message
    failed: list[str] = []  # dropped by a failure in the core (error says why)
    error: str | None = None
    stats: dict[str, Any] | None = None  # EngineStats after this step
    step: bool = False  # these outputs are one engine step's (step listeners run)
    utility: tuple | None = None  # (call id, ok, result or error message)
    ready: dict[str, Any] | None = None  # the handshake: num_blocks, block_size, max_model_len, ...
    startup_error: str | None = None  # the core could not start: why, in one line
    fatal: str | None = None  # the core is about to exit, and why (a tensor-parallel worker died)
