"""What the scheduler sends the workers for one step (vLLM V1's ``v1/core/sched/output.py``).

A diff, not live requests: a request the workers have not seen (new, or resumed after a
preemption, which made them drop it) comes whole as a ``NewRequestData``; afterwards it is one
entry of ``CachedRequestData`` (its new blocks and where its tokens start). The workers keep
everything else (engine/worker/states.py). The same object goes to the in-process worker and,
msgpack-encoded once, to every tensor-parallel rank. ``GrammarOutput`` is the step's grammar
bitmask, computed after the forward pass was launched (``Scheduler.get_grammar_bitmask``).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engine.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the workers do not hold (V1's fields; prefill_token_ids as Model Runner V2's)."""
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: tuple[list[int], ...]  # one list per KV-cache group
    num_computed_tokens: int  # where this step's tokens start (prefix-cache hits are already computed)
    prefill_token_ids: list[int]  # every token to compute: the prompt, and after a preemption what it generated
    eos_token_id: int | None = None
    seed: int = 0  # the request's sampling seed: every rank draws what the engine's own sampler would


@dataclass
class CachedRequestData:
    """The requests the workers already hold, as parallel lists (V1's fields)."""
    req_ids: list[str] = field(default_factory=list)
    # their new_block_ids replace the table (V1's field: Model Runner V2 drops a preempted request,
    # which comes back as NewRequestData, so it stays empty here)
    resumed_req_ids: set[str] = field(default_factory=set)
    new_token_ids: list[list[int]] = field(default_factory=list)  # empty lists: the workers keep their tokens
    all_token_ids: dict[str, list[int]] = field(default_factory=dict)
    new_block_ids: list[tuple[list[int], ...] | None] = field(default_factory=list)  # appended to the table
    num_computed_tokens: list[int] = field(default_factory=list)  # where this step's tokens start
    num_output_tokens: list[int] = field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


@dataclass
class SchedulerOutput:
    """One step's schedule (V1's fields), then what the trace shows about it (ours)."""
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: CachedRequestData = field(default_factory=CachedRequestData)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)  # in batch order
    total_num_scheduled_tokens: int = 0
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)  # drafts to verify
    finished_req_ids: set[str] = field(default_factory=set)  # finished or aborted since the last step
    preempted_req_ids: set[str] = field(default_factory=set)  # the workers drop them (Model Runner V2)
    kv_connector_metadata: Any = None  # a KV connector's plan for its worker side (a KVConnectorMetadata)
    # ours: the step, and for the trace who was admitted and why the others wait
    step: int = 0
    admitted: list[str] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)  # preempted_req_ids in preemption order
    resumed: list[str] = field(default_factory=list)  # sent whole again after a preemption
    waiting_reasons: dict[str, str] = field(default_factory=dict)  # request id -> why not admitted
    token_budget: int = 0
    grammar_failed: dict[str, str] = field(default_factory=dict)  # request id -> why (finished, never ran)
    # async scheduling (V1's): a request with a grammar has tokens in flight, so its bitmask (and the
    # step's sampling) waits until the previous step's tokens are known
    pending_structured_output_tokens: bool = False
    # async scheduling (V1's): request id -> how many of its placeholder draft ids turned out to be no
    # draft (the worker had fewer, or its grammar refused them): -1 in scheduled_spec_decode_tokens, and
    # not counted as proposed (update_draft_token_ids_in_output)
    num_invalid_spec_tokens: dict[str, int] | None = None

    @property
    def req_ids(self) -> list[str]:
        return list(self.num_scheduled_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens

    def num_computed_before(self) -> dict[str, int]:
        """Request id -> where its tokens start this step."""
        out = {n.req_id: n.num_computed_tokens for n in self.scheduled_new_reqs}
        c = self.scheduled_cached_reqs
        out.update(zip(c.req_ids, c.num_computed_tokens))
        return out


@dataclass
class GrammarOutput:
    """The step's grammar bitmask (V1's fields): one row per position a constrained request may score
    (1 + its scheduled drafts, placeholders included), in structured_output_request_ids order; bit j of
    word w allows token 32 w + j."""
    structured_output_request_ids: list[str]
    grammar_bitmask: np.ndarray  # [rows, ceil(vocab / 32)] int32
    # per request, in the same order: how many leading drafts its rows constrain (the drafts before the
    # first -1); the model runner verifies no draft past them (its rows allow every token)
    num_acceptable_drafts: list[int] | None = None


_SIZE_ENCODERS = threading.local()  # a msgspec Encoder keeps its buffer between calls: one a thread


def _size_encoder():
    """This thread's encoder for diff_summary (every traced step on the engine's; a lesson's as well),
    made once rather than at each call."""
    enc = getattr(_SIZE_ENCODERS, "enc", None)
    if enc is None:
        from engine.serial_utils import encoder  # (the wire format is the serving layer's)

        enc = _SIZE_ENCODERS.enc = encoder()
    return enc


def diff_summary(sched: SchedulerOutput) -> dict:
    """What the step's SchedulerOutput tells the workers, for the trace: who comes whole, who as a
    diff, and the size of the message every tensor-parallel rank receives (msgpack bytes)."""
    c = sched.scheduled_cached_reqs
    return {"new": [n.req_id for n in sched.scheduled_new_reqs], "cached": list(c.req_ids),
            "resumed": list(sched.resumed), "preempted": sorted(sched.preempted_req_ids),
            "finished": sorted(sched.finished_req_ids), "num_bytes": len(_size_encoder().encode(sched))}
