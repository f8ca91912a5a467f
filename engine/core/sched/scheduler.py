"""The scheduler (vLLM v1): decides, each step, which requests run and how many tokens each.

There is no separate prefill phase: every request just has ``num_computed_tokens`` out of
``num_tokens``, and a step gives it some of the difference. Running requests go first
(a decode needs 1 token, an unfinished chunked prefill the rest of its prompt), then waiting
requests are admitted in arrival order while the token budget, ``max_num_seqs`` and free
blocks allow. A long prompt is split across steps (chunked prefill). When blocks run out,
the most recently admitted running request is preempted: its blocks are freed and it goes
back to the front of ``waiting`` to be recomputed later.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.config import SchedulerConfig
from engine.core.block_manager import BlockManager
from engine.hooks import BEGIN, Hooks
from engine.request import Request, RequestStatus
from engine.trace_names import PREEMPTED, SCHEDULE, SCHEDULER


@dataclass
class ScheduledRequest:
    request: Request
    num_tokens: int  # tokens computed for it this step
    num_computed_before: int  # where this step's tokens start
    is_prefill: bool


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
    def total_num_scheduled_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Decides each step's batch under one token budget (vLLM V1: no prefill or decode phases).

    Owns the ``waiting`` queue and the ``running`` list. Running requests go first, then waiting
    ones, first come first served; when the BlockManager has no free block for a running request,
    the most recently admitted one is preempted (recompute: its blocks are freed and it goes back
    to the front of ``waiting``). It moves token counts only: the ModelRunner computes them and
    the engine applies the results."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, hooks: Hooks | None = None):
        self.config = config
        self.block_manager = block_manager
        self.hooks = hooks or Hooks()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.finished_req_ids: set[str] = set()  # handed to the next SchedulerOutput

    def add_request(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, step: int) -> SchedulerOutput:
        """This step's batch, within max_num_batched_tokens and max_num_seqs.

        Takes the step number (for the trace). Returns the scheduled requests, each with how many
        tokens it computes from which position, and who was admitted, preempted or left waiting
        (and why). Changes: allocates KV blocks (prefix-cache hits on admission), moves admitted
        requests from waiting to running and preempted ones back to waiting with
        num_computed_tokens 0; it does not advance num_computed_tokens (the engine does, after
        the step ran). Hooks: scheduler/schedule begin, PREEMPTED per preemption, the block
        manager's cache_hit/cache_miss, allocate, evict and free. The schedule's snapshot and end
        event come from LLMEngine after it returns."""
        self.block_manager.step = step
        if self.hooks.active:
            self.hooks.emit(
                SCHEDULER, SCHEDULE, BEGIN, step=step, num_waiting=len(self.waiting), num_running=len(self.running)
            )
        out = SchedulerOutput(step=step, token_budget=self.config.max_num_batched_tokens,
                              finished_req_ids=self.finished_req_ids)
        self.finished_req_ids = set()
        budget = self.config.max_num_batched_tokens

        # 1. Running requests first, in admission order.
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            remaining = len(req.all_token_ids) - req.num_computed_tokens
            n = min(remaining, budget)
            while not self.block_manager.allocate_slots(req, n):
                victim = self.running.pop()  # the most recently admitted
                self._preempt(victim, out, reason=f"no free blocks for {req.request_id}")
                if victim is req:
                    break
            else:  # (Request.is_prefill, inlined: this runs for every running request every step)
                is_prefill = remaining > 1 or not req.output_token_ids
                out.scheduled.append(ScheduledRequest(req, n, req.num_computed_tokens, is_prefill))
                budget -= n
                i += 1
                continue
            break  # req itself was preempted

        # 2. Then admit waiting requests, first come first served.
        reason = "preemption this step" if out.preempted else None
        while reason is None and self.waiting:
            if budget <= 0:
                reason = "token budget used up"
            elif len(self.running) >= self.config.max_num_seqs:
                reason = "max_num_seqs reached"
            else:
                reason = self._try_admit(self.waiting[0], budget, out)
                if reason is None:
                    budget -= out.scheduled[-1].num_tokens
        if reason is not None:
            out.waiting_reasons = {r.request_id: reason for r in self.waiting}
        return out

    def _try_admit(self, req: Request, budget: int, out: SchedulerOutput) -> str | None:
        """Admit the head of `waiting`, or return why not."""
        computed = self.block_manager.get_computed_blocks(req)
        num_cached = len(computed) * self.block_manager.block_size
        n = req.num_tokens - num_cached
        if n > budget and not self.config.enable_chunked_prefill:
            return "token budget too small for the whole prompt (chunked prefill off)"
        n = min(n, budget)
        if not self.block_manager.allocate_slots(req, n, computed):
            return "not enough free KV-cache blocks"
        self.waiting.popleft()
        req.num_computed_tokens = req.num_cached_tokens = num_cached
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        out.admitted.append(req.request_id)
        out.scheduled.append(ScheduledRequest(req, n, num_cached, req.is_prefill))
        return None

    def _preempt(self, req: Request, out: SchedulerOutput, reason: str) -> None:
        self.block_manager.free_request(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0  # recompute: prompt and generated tokens are prefilled again
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted.append(req.request_id)
        if self.hooks.active:
            self.hooks.emit(SCHEDULER, PREEMPTED, request_id=req.request_id, step=out.step, reason=reason)

    def finish_requests(self, req: Request, status: RequestStatus) -> None:
        """Remove a finished (or aborted) request and free its blocks. (V1's takes request ids: its
        scheduler keeps an id -> request map, ours leaves that to the engine.)"""
        req.status = status
        self.finished_req_ids.add(req.request_id)
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.block_manager.free_request(req)
