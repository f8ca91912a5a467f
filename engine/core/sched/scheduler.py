"""The scheduler (vLLM v1): decides, each step, which requests run and how many tokens each.

There is no separate prefill phase: every request just has ``num_computed_tokens`` out of
``num_tokens``, and a step gives it some of the difference. Running requests go first
(a decode needs 1 token, an unfinished chunked prefill the rest of its prompt), then waiting
requests are admitted in arrival order while the token budget, ``max_num_seqs`` and free
blocks allow. A long prompt is split across steps (chunked prefill). When blocks run out,
the most recently admitted running request is preempted: its blocks are freed and it goes
back to the front of ``waiting`` to be recomputed later.

With ``policy="priority"`` (vLLM V1's other policy) ``waiting`` is kept ordered by
(priority, arrival time), lower first, and the preemption victim is the running request with
the largest (priority, arrival time): the least important, and of those the newest.

After the model ran, ``update_from_output`` applies what it sampled: it advances each
request, appends its token, checks EOS / stop_token_ids / min_tokens / max_tokens, frees
what finished and returns one ``EngineCoreOutput`` per request that got a token.
"""
from __future__ import annotations

import time
from bisect import insort
from collections import deque
from typing import Iterable

from engine.config import SchedulerConfig
from engine.core.block_manager import BlockManager
from engine.core.sched.output import ScheduledRequest, SchedulerOutput
from engine.core.sched.utils import check_stop
from engine.engine.core_types import EngineCoreOutput, EngineCoreOutputs
from engine.hooks import BEGIN, Hooks
from engine.request import Request, RequestStatus
from engine.sample.sampler import SamplerOutput
from engine.structured_output import StructuredOutputManager
from engine.trace_names import (
    BITMASK,
    DRAFTS_VALIDATED,
    ENGINE,
    FINISHED,
    GRAMMAR_COMPILED,
    GRAMMAR_REJECTED,
    PREEMPTED,
    REJECTED,
    SCHEDULE,
    SCHEDULER,
    SPEC_DECODE,
    STRUCTURED_OUTPUT,
    VERIFIED,
)


class Scheduler:
    """Decides each step's batch under one token budget (vLLM V1: no prefill or decode phases).

    Owns the ``waiting`` queue and the ``running`` list. Running requests go first, then waiting
    ones, first come first served; when the BlockManager has no free block for a running request,
    the most recently admitted one is preempted (recompute: its blocks are freed and it goes back
    to the front of ``waiting``). ``schedule`` moves token counts only; ``update_from_output``
    applies what the model sampled. Owns ``requests`` (every unfinished request by id) and
    ``step_count`` (steps scheduled and updated so far)."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, max_model_len: int,
                 hooks: Hooks | None = None, structured_output_manager: StructuredOutputManager | None = None,
                 num_lookahead_tokens: int = 0):
        self.config = config
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.hooks = hooks or Hooks()
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.step_count = 0
        self.num_preemptions = 0
        self.spec_stats = SpecDecodingStats()
        self.finished_req_ids: set[str] = set()  # handed to the next SchedulerOutput
        self.structured_output_manager = structured_output_manager  # grammars: compiles, bitmasks, matchers
        # slots past a request's scheduled tokens, for a draft model's proposals (V1's num_lookahead_tokens)
        self.num_lookahead_tokens = num_lookahead_tokens

    def add_request(self, req: Request) -> None:
        self.requests[req.request_id] = req
        if self.config.policy == "priority":
            insort(self.waiting, req, key=_priority)
        else:
            self.waiting.append(req)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        """This step's batch, within max_num_batched_tokens and max_num_seqs.

        Returns the scheduled requests, each with how many
        tokens it computes from which position, and who was admitted, preempted or left waiting
        (and why). Changes: allocates KV blocks (prefix-cache hits on admission), moves admitted
        requests from waiting to running and preempted ones back to waiting with
        num_computed_tokens 0; it does not advance num_computed_tokens (update_from_output does,
        after the step ran). Hooks: scheduler/schedule begin, PREEMPTED per preemption, the block
        manager's cache_hit/cache_miss, allocate, evict and free. The schedule's snapshot and end
        event come from EngineCore after it returns."""
        step = self.block_manager.step = self.step_count
        if self.hooks.active:
            self._trace_schedule_begin(step)
        out = SchedulerOutput(step=step, token_budget=self.config.max_num_batched_tokens,
                              finished_req_ids=self.finished_req_ids)
        self.finished_req_ids = set()
        budget = self.config.max_num_batched_tokens

        # 1. Running requests first, in admission order.
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            remaining = len(req.all_token_ids) - req.num_computed_tokens
            n = min(remaining + len(req.spec_token_ids), budget)  # draft tokens: lookahead slots to verify
            while not self._allocate(req, n, req.num_computed_tokens + n):
                victim, why = self._victim()
                self._preempt(victim, out, reason=f"{why}no free blocks for {req.request_id}")
                if victim is req:
                    break
            else:  # (Request.is_prefill, inlined: this runs for every running request every step)
                is_prefill = remaining > 1 or not req.output_token_ids
                spec, req.spec_token_ids = req.spec_token_ids[:max(0, n - remaining)], []
                out.scheduled.append(ScheduledRequest(req, n, req.num_computed_tokens, is_prefill, spec))
                budget -= n
                i += 1
                continue
            break  # req itself was preempted

        # 2. Then admit waiting requests, first come first served.
        reason = "preemption this step" if out.preempted else None
        skipped: list[Request] = []  # waiting for their grammar: passed over, put back in front after
        while reason is None and self.waiting:
            if budget <= 0:
                reason = "token budget used up"
            elif len(self.running) >= self.config.max_num_seqs:
                reason = "max_num_seqs reached"
            elif (self.waiting[0].status is RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
                  and not self._grammar_ready(out, skipped)):
                continue  # passed over (its grammar is compiling) or finished (its grammar failed)
            else:
                reason = self._try_admit(self.waiting[0], budget, out)
                if reason is None:
                    budget -= out.scheduled[-1].num_tokens
        if reason is not None:
            out.waiting_reasons = {r.request_id: reason for r in self.waiting}
        if skipped:
            self.waiting.extendleft(reversed(skipped))
            out.waiting_reasons |= {r.request_id: "its grammar is compiling (WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR)"
                                    for r in skipped}
        if self.structured_output_manager is not None:
            self._grammar_bitmask(out)
        return out

    # ---- structured outputs (engine/structured_output) ----------------------------------------
    def _grammar_ready(self, out: SchedulerOutput, skipped: list[Request]) -> bool:
        """For the head of `waiting`, WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR: whether its grammar has
        compiled (it is then WAITING, admitted as any other). If not, it leaves `waiting`: into
        `skipped` while its grammar compiles, finished if its grammar failed."""
        req = self.waiting[0]
        if not self.structured_output_manager.check_ready(req):
            skipped.append(self.waiting.popleft())
            return False
        so = req.structured_output_request
        if so.error is not None:
            self.waiting.popleft()
            req.stop_reason = so.error
            out.grammar_failed[req.request_id] = so.error
            self.finish_requests((req.request_id,), RequestStatus.FINISHED_ABORTED)
        else:
            req.status = RequestStatus.WAITING
        if self.hooks.active:
            self._trace_grammar_compiled(req, out.step)
        return so.error is None

    def waiting_for_grammars(self) -> bool:
        """Nothing can run until a grammar compiles: nothing is running, and every waiting request
        waits for its grammar."""
        return not self.running and bool(self.waiting) and all(
            r.status is RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
            and not r.structured_output_request.compiled.done()
            for r in self.waiting)

    def _grammar_bitmask(self, out: SchedulerOutput) -> None:
        """The batch's grammar bitmask (V1's grammar_bitmask): for each scheduled request with a
        grammar whose step samples a token (a chunk that does not end the prefill samples none),
        one row per position it scores: one per draft it verifies, then one more."""
        scheduled = [s for s in out.scheduled if s.request.structured_output_request is not None
                     and s.num_computed_before + s.num_tokens >= s.request.num_tokens]
        if not scheduled:
            return
        t0 = time.perf_counter_ns()
        reqs, drafts = [s.request for s in scheduled], [s.spec_token_ids for s in scheduled]
        out.grammar_bitmask, allowed = self.structured_output_manager.grammar_bitmask(reqs, drafts)
        row = 0
        for r, d in zip(reqs, drafts):
            out.structured_output_request_ids[r.request_id] = row  # its first row; 1 + len(d) rows in all
            out.grammar_allowed[r.request_id] = allowed[row]
            out.grammar_allowed_per_pos[r.request_id] = allowed[row:row + 1 + len(d)]
            row += 1 + len(d)
        if self.hooks.active:
            self._trace_grammar_bitmask(out, reqs, time.perf_counter_ns() - t0)

    def _advance_grammar(self, req: Request, token_id: int, out: SchedulerOutput, pos: int) -> None:
        """After sampling: the request's matcher accepts its token (V1's accept_tokens), the one at
        position `pos` of the step's (0 unless drafts were accepted before it)."""
        so = req.structured_output_request
        counts = out.grammar_allowed_per_pos.get(req.request_id)
        so.num_allowed.append(counts[pos] if counts else None)
        if not self.structured_output_manager.accept_token(req, token_id) and self.hooks.active:
            self._trace_grammar_rejected(req, token_id, out.step)

    def _trace_grammar_rejected(self, req: Request, token_id: int, step: int) -> None:
        self.hooks.emit(STRUCTURED_OUTPUT, GRAMMAR_REJECTED, request_id=req.request_id, step=step, token_id=token_id)

    def _trace_grammar_compiled(self, req: Request, step: int) -> None:
        so = req.structured_output_request
        self.hooks.emit(STRUCTURED_OUTPUT, GRAMMAR_COMPILED, request_id=req.request_id, step=step, kind=so.kind,
                        compile_s=so.compile_s, cache_hit=so.cache_hit, error=so.error,
                        waited_s=time.monotonic() - so.queued_at)

    def _trace_grammar_bitmask(self, out: SchedulerOutput, reqs: list[Request], fill_ns: int) -> None:
        mgr = self.structured_output_manager
        allowed = mgr.preview(out.grammar_bitmask, out.structured_output_request_ids, out.grammar_allowed)
        # draft positions: the mask of each (allowed tokens after 0, 1, ... of the drafts)
        per_pos = {rid: n for rid, n in out.grammar_allowed_per_pos.items() if len(n) > 1}
        self.hooks.emit(STRUCTURED_OUTPUT, BITMASK, step=out.step, vocab_size=mgr.vocab_size, fill_ns=fill_ns,
                        num_allowed=out.grammar_allowed, allowed=allowed, num_allowed_per_pos=per_pos,
                        terminated=[r.request_id for r in reqs if r.structured_output_request.grammar.is_terminated()])

    def _try_admit(self, req: Request, budget: int, out: SchedulerOutput) -> str | None:
        """Admit the head of `waiting`, or return why not."""
        computed = self.block_manager.get_computed_blocks(req)
        num_cached = len(computed) * self.block_manager.block_size
        n = req.num_tokens - num_cached
        if n > budget and not self.config.enable_chunked_prefill:
            return "token budget too small for the whole prompt (chunked prefill off)"
        n = min(n, budget)
        if not self._allocate(req, n, num_cached + n, computed):
            return "not enough free KV-cache blocks"
        self.waiting.popleft()
        req.num_computed_tokens = req.num_cached_tokens = num_cached
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        out.admitted.append(req.request_id)
        out.scheduled.append(ScheduledRequest(req, n, num_cached, req.is_prefill))
        return None

    def _allocate(self, req: Request, n: int, end: int, computed: list[int] = ()) -> bool:
        """The block manager's allocate_slots for n more tokens of req (computed up to `end` after
        this step), and with a draft model num_lookahead_tokens slots past them when the step reaches
        req's last token (the draft then proposes from it), within max_model_len. Lookahead slots that
        do not fit are left out rather than preempting anyone for them: the draft proposes fewer."""
        bm = self.block_manager
        lookahead = 0
        if self.num_lookahead_tokens and end >= req.num_tokens:
            lookahead = max(0, min(self.num_lookahead_tokens, self.max_model_len - end))
        return bool(lookahead) and bm.allocate_slots(req, n, computed, lookahead) or bm.allocate_slots(req, n, computed)

    def _victim(self) -> tuple[Request, str]:
        """Who is preempted when blocks run out, taken out of `running`, and why them (under FCFS: the most
        recently admitted, which needs no saying)."""
        if self.config.policy == "priority":
            victim = max(self.running, key=_priority)
            self.running.remove(victim)
            return victim, f"lowest priority ({victim.priority}): "
        return self.running.pop(), ""

    def _preempt(self, req: Request, out: SchedulerOutput, reason: str) -> None:
        self.block_manager.free_request(req)
        req.status = RequestStatus.PREEMPTED
        req.spec_token_ids = []
        req.num_computed_tokens = 0  # recompute: prompt and generated tokens are prefilled again
        req.num_preemptions += 1
        self.num_preemptions += 1
        if self.config.policy == "priority":
            insort(self.waiting, req, key=_priority)
        else:
            self.waiting.appendleft(req)
        out.preempted.append(req.request_id)
        if self.hooks.active:
            self.hooks.emit(SCHEDULER, PREEMPTED, request_id=req.request_id, step=out.step, reason=reason)

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: SamplerOutput | None) -> EngineCoreOutputs:
        """Apply one step's sampled tokens (None: nothing ran).

        Per scheduled request: num_computed_tokens advances by what it computed; a request whose
        prefill is still unfinished (a chunk) discards its token; the others append it, are
        checked for EOS / stop_token_ids / max_tokens / max_model_len (after min_tokens), and,
        if finished, freed. Returns one EngineCoreOutput per request that got a token (no text:
        the front end detokenizes). Hooks: engine/FINISHED per finished request, after its
        blocks are freed. step_count + 1."""
        outputs, now, step = [], time.monotonic(), scheduler_output.step
        for rid, error in scheduler_output.grammar_failed.items():  # finished in schedule(), never ran
            outputs.append(EngineCoreOutput(rid, [], finish_reason="abort", stop_reason=error))
        sampled = model_runner_output.token_ids if model_runner_output is not None else ()
        for i, (s, token_id) in enumerate(zip(scheduler_output.scheduled, sampled)):
            req = s.request
            req.first_scheduled_time = req.first_scheduled_time or now
            req.num_computed_tokens += s.num_tokens
            tokens = [token_id]
            if s.spec_token_ids:  # drafts verified: keep what the rejection sampler kept; rejected slots get rewritten
                tokens = model_runner_output.spec_token_ids[i]
                req.num_computed_tokens -= len(s.spec_token_ids) + 1 - len(tokens)
                self.spec_stats.observe(len(s.spec_token_ids), len(tokens) - 1)
                if self.hooks.active:
                    self._trace_verified(req, step, s.spec_token_ids, tokens)
            if model_runner_output.prompt_logprobs and model_runner_output.prompt_logprobs[i] is not None:
                _add_prompt_logprobs(req, *model_runner_output.prompt_logprobs[i])
            if req.num_computed_tokens < len(req.all_token_ids):
                continue  # one chunk of a longer prefill: its sampled token is discarded
            new_token_ids = []
            for pos, token_id in enumerate(tokens):
                req.append_token(token_id)
                new_token_ids.append(token_id)
                if req.structured_output_request is not None:
                    self._advance_grammar(req, token_id, scheduler_output, pos)
                status = check_stop(req, self.max_model_len)
                if status is not None:
                    break  # the rest (accepted drafts past a stop) is dropped
            req.first_token_time = req.first_token_time or now
            if status is not None:
                req.finished_time = now
                self.finish_requests((req.request_id,), status)
            lps = model_runner_output.logprobs[i]
            new_logprobs = None if lps is None else [_ranked(lps, token_id, model_runner_output.ranks[i])]
            if s.spec_token_ids and lps is not None:  # one entry per kept token, each from its own position
                new_logprobs = [_ranked(lp, t, rank) for (lp, rank), t in
                                zip(model_runner_output.spec_logprobs[i], new_token_ids)]
            outputs.append(_output(req, new_token_ids, new_logprobs))
            if status is not None and self.hooks.active:
                self._trace_finished(req, step)
        self.step_count += 1
        return EngineCoreOutputs(outputs=outputs)

    def finish_requests(self, request_ids: Iterable[str], finished_status: RequestStatus) -> None:
        """Remove finished (or aborted) requests and free their blocks. Unknown or finished ids
        are ignored."""
        for rid in request_ids:
            req = self.requests.pop(rid, None)
            if req is None or req.status.finished:
                continue
            req.status = finished_status
            self.finished_req_ids.add(rid)
            if req in self.running:
                self.running.remove(req)
            elif req in self.waiting:
                self.waiting.remove(req)
            self.block_manager.free_request(req)

    def _trace_schedule_begin(self, step: int) -> None:
        self.hooks.emit(SCHEDULER, SCHEDULE, BEGIN, step=step, num_waiting=len(self.waiting),
                        num_running=len(self.running))

    def update_draft_token_ids(self, draft_token_ids: dict[str, list[int]]) -> None:
        """The proposer's drafts for the next step (vLLM V1's name): scheduled as lookahead slots.
        A request with a grammar keeps the longest prefix its grammar accepts (its matcher checks
        them and rolls back): a draft the grammar forbids could never be accepted, and the tokens
        after it are not worth verifying."""
        for rid, drafts in draft_token_ids.items():
            req = self.requests.get(rid)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue
            so = req.structured_output_request
            if so is not None and drafts:
                proposed, drafts = drafts, so.grammar.validate_tokens(drafts)
                if self.hooks.active:
                    self._trace_drafts_validated(req, proposed, drafts)
            req.spec_token_ids = drafts

    def _trace_drafts_validated(self, req: Request, proposed: list[int], kept: list[int]) -> None:
        self.hooks.emit(STRUCTURED_OUTPUT, DRAFTS_VALIDATED, request_id=req.request_id, step=self.step_count,
                        draft=proposed, kept=kept, cut=proposed[len(kept):])

    def _trace_verified(self, req: Request, step: int, drafts: list[int], kept: list[int]) -> None:
        accepted = len(kept) - 1  # the kept tokens: the accepted drafts, then the target's own token
        self.hooks.emit(SPEC_DECODE, VERIFIED, request_id=req.request_id, step=step, draft=drafts,
                        accepted=drafts[:accepted], rejected=drafts[accepted:], token=kept[-1],
                        bonus=accepted == len(drafts))
        if accepted < len(drafts):
            self.hooks.emit(SPEC_DECODE, REJECTED, request_id=req.request_id, step=step, rejected=drafts[accepted:])

    def _trace_finished(self, req: Request, step: int) -> None:
        self.hooks.emit(ENGINE, FINISHED, request_id=req.request_id, step=step, finish_reason=req.finish_reason,
                        stop_reason=req.stop_reason, num_output_tokens=req.num_output_tokens)


class SpecDecodingStats:
    """vLLM V1's spec-decode counters: drafts verified, draft tokens, accepted tokens, and accepted
    tokens by position in the draft."""

    def __init__(self):
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.num_accepted_tokens_per_pos: list[int] = []

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        per_pos = self.num_accepted_tokens_per_pos
        per_pos += [0] * (num_draft_tokens - len(per_pos))
        for j in range(num_accepted):
            per_pos[j] += 1


def _priority(req: Request) -> tuple[int, float]:
    return req.priority, req.arrival_time


def _ranked(logprobs: dict[int, float], sampled: int, sampled_rank: int) -> list[list]:
    """[[token id, logprob, rank], ...] best first; the sampled token keeps its rank in the whole vocabulary."""
    ranked = sorted(logprobs.items(), key=lambda kv: -kv[1])
    return [[t, lp, sampled_rank if t == sampled else i + 1] for i, (t, lp) in enumerate(ranked)]


def _add_prompt_logprobs(req: Request, first: int, entries: list) -> None:
    """Keep the entries for prompt positions not collected yet (a preempted request recomputes its prompt)."""
    skip = len(req.prompt_logprobs) - first
    if 0 <= skip < len(entries):
        req.prompt_logprobs += entries[skip:]


def _output(req: Request, new_token_ids: list[int], new_logprobs: list | None) -> EngineCoreOutput:
    # Positional arguments: built for every running request every step, so it counts.
    metrics = None
    if req.num_output_tokens == len(new_token_ids) or req.finished_time is not None:  # the first, and the finish
        metrics = dict(arrival_time=req.arrival_time, first_scheduled_time=req.first_scheduled_time,
                       first_token_time=req.first_token_time, finished_time=req.finished_time,
                       num_preemptions=req.num_preemptions)
    prompt_logprobs = None
    if req.num_output_tokens == len(new_token_ids) and req.params.prompt_logprobs is not None:
        prompt_logprobs = req.prompt_logprobs
    return EngineCoreOutput(req.request_id, new_token_ids, new_logprobs, req.finish_reason, req.stop_reason,
                            req.num_cached_tokens, metrics, prompt_logprobs)
