"""What the scheduler decided for one step (vLLM V1's ``v1/core/sched/output.py``)."""
from __future__ import annotations

from dataclasses import dataclass, field

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
