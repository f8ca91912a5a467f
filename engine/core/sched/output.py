"""What the scheduler decided for one step (vLLM V1's ``v1/core/sched/output.py``)."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from engine.request import Request


@dataclass
class ScheduledRequest:
    request: Request
    num_tokens: int  # tokens computed for it this step
    num_computed_before: int  # where this step's tokens start
    is_prefill: bool
    spec_token_ids: list[int] = field(default_factory=list)  # drafts to verify (their slots are in num_tokens)


@dataclass
class SchedulerOutput:
    step: int
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    admitted: list[str] = field(default_factory=list)
    waiting_reasons: dict[str, str] = field(default_factory=dict)  # request id -> why not admitted
    token_budget: int = 0
    # finished or aborted since the last step (V1's name): workers drop the state they keep for them
    finished_req_ids: set[str] = field(default_factory=set)
    # structured outputs (V1's names): request id -> its first row of grammar_bitmask (1 + its number of drafts
    # rows: one per position it scores), the rows ([n, ceil(vocab / 32)] int32, bit j of word w allows token
    # 32 w + j), how many tokens its first row allows and each of its rows; grammars that failed
    structured_output_request_ids: dict[str, int] = field(default_factory=dict)
    grammar_bitmask: np.ndarray | None = None
    grammar_allowed: dict[str, int] = field(default_factory=dict)
    grammar_allowed_per_pos: dict[str, list[int]] = field(default_factory=dict)
    grammar_failed: dict[str, str] = field(default_factory=dict)  # request id -> why (finished, never ran)

    @property
    def num_scheduled_tokens(self) -> dict[str, int]:
        """Request id -> tokens computed for it this step (vLLM V1's name and shape)."""
        return {s.request.request_id: s.num_tokens for s in self.scheduled}

    @property
    def scheduled_spec_decode_tokens(self) -> dict[str, list[int]]:
        """Request id -> the draft tokens it verifies this step (vLLM V1's name)."""
        return {s.request.request_id: s.spec_token_ids for s in self.scheduled if s.spec_token_ids}

    @property
    def req_ids(self) -> list[str]:
        return [s.request.request_id for s in self.scheduled]

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
