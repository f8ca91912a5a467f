"""A request as the engine sees it: tokens, progress, blocks and status."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "WAITING"
    # in waiting, its grammar still compiling: the scheduler passes over it
    WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR = "WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR"
    RUNNING = "RUNNING"
    # in waiting, its blocks allocated, while a KV connector receives their KV from another instance
    WAITING_FOR_REMOTE_KVS = "WAITING_FOR_REMOTE_KVS"
    PREEMPTED = "PREEMPTED"  # back in waiting; its blocks were freed, it will be recomputed
    FINISHED_STOPPED = "FINISHED_STOPPED"
    FINISHED_LENGTH = "FINISHED_LENGTH"
    FINISHED_ABORTED = "FINISHED_ABORTED"

    @property
    def finished(self) -> bool:
        return self._value_.startswith("FINISHED")  # _value_, a plain attribute: .name is slow


FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_id: int | None
    max_tokens: int  # resolved: params.max_tokens or what fits in max_model_len
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0  # with scheduling_policy "priority": lower values are scheduled first
    kv_transfer_params: dict | None = None  # a KV connector's: in with the request, out with its last output

    def __post_init__(self) -> None:
        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.num_cached_tokens = 0  # of those, found in the prefix cache (or delivered by a KV connector) at admission
        self.num_external_computed_tokens = 0  # of those, delivered by a KV connector
        # its block table in each KV-cache group: logical block i -> physical block (one group: dense)
        self.kv_block_ids: list[list[int]] = [[]]
        self.block_hashes: list[int] = []  # hash of each full block, a chain over the tokens
        self.num_preemptions = 0
        self.prompt_logprobs: list[list] = []  # with params.prompt_logprobs: for prompt positions 1.. so far
        self.spec_token_ids: list[int] = []  # speculative decoding: drafts to verify in the next step
        # async scheduling: tokens of steps still in flight, counted in num_computed_tokens but not sampled yet
        self.num_output_placeholders = 0
        self.is_prefill_chunk = False  # its last scheduled step ends before its last token (it samples nothing)
        self.sampling_seed: int | None = None  # set by the engine: params.seed, else a random one
        self.structured_output_request = None  # a StructuredOutputRequest when params.structured_outputs
        self.stop_reason: int | str | None = None
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finished_time: float | None = None

    @property
    def block_ids(self) -> list[int]:
        """The block table of the first KV-cache group (a dense model's only one)."""
        return self.kv_block_ids[0]

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_prefill(self) -> bool:
        """Still computing tokens it did not sample itself: its prompt, or, after a
        preemption, its prompt and everything generated so far."""
        return self.num_tokens - self.num_computed_tokens > 1 or not self.output_token_ids

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    @property
    def use_structured_output(self) -> bool:
        return self.structured_output_request is not None

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASON.get(self.status)
