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

``schedule`` returns the step as the diff the workers need (``SchedulerOutput``) and counts the
scheduled tokens as computed (``_update_after_schedule``); ``get_grammar_bitmask`` fills the
grammar bitmask while the forward pass runs. After sampling, ``update_from_output`` takes back
the drafts the model rejected, appends each request's tokens, checks EOS / stop_token_ids /
min_tokens / max_tokens, frees what finished and returns one ``EngineCoreOutput`` per request
that got a token.
"""
from __future__ import annotations

import time
from bisect import insort
from collections import deque
from typing import Iterable

from engine.config import SchedulerConfig
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.sched.output import GrammarOutput, NewRequestData, SchedulerOutput
from engine.core.sched.utils import check_stop
from engine.engine.core_types import EngineCoreOutput, EngineCoreOutputs
from engine.hooks import BEGIN, Hooks
from engine.outputs import DraftTokenIds, ModelRunnerOutput
from engine.request import Request, RequestStatus
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
    ones, first come first served; when the KVCacheManager has no free block for a running request,
    the most recently admitted one is preempted (recompute: its blocks are freed and it goes back
    to the front of ``waiting``). ``schedule`` moves token counts only; ``update_from_output``
    applies what the model sampled. Owns ``requests`` (every unfinished request by id) and
    ``step_count`` (steps scheduled and updated so far)."""

    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager, max_model_len: int,
                 hooks: Hooks | None = None, structured_output_manager: StructuredOutputManager | None = None,
                 num_lookahead_tokens: int = 0, connector=None):
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.max_model_len = max_model_len
        self.hooks = hooks or Hooks()
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.step_count = 0
        self.num_scheduled_steps = 0  # ahead of step_count while a step is in flight (async scheduling)
        self.num_preemptions = 0
        self.spec_stats = SpecDecodingStats()
        self.expert_load = ExpertLoadStats()  # a mixture of experts: tokens per expert, per layer
        self.finished_req_ids: set[str] = set()  # handed to the next SchedulerOutput
        self.structured_output_manager = structured_output_manager  # grammars: compiles, bitmasks, matchers
        # slots past a request's scheduled tokens, for a draft model's proposals (V1's num_lookahead_tokens)
        self.num_lookahead_tokens = num_lookahead_tokens
        self._sent_blocks: dict[str, tuple[int, ...]] = {}  # request id -> blocks of its tables the workers hold
        # request id -> how many tokens its grammar allowed at each position it scores (the last bitmask)
        self.grammar_allowed_per_pos: dict[str, list[int]] = {}
        # a KV connector's scheduler side (engine/distributed/kv_transfer), or None
        self.connector = connector
        self.finished_recving_kv_req_ids: set[str] = set()  # their remote KV arrived: schedule them
        self.failed_kv_block_ids: set[int] = set()  # blocks whose remote KV did not arrive: computed instead
        self._delayed_frees: dict[str, Request] = {}  # finished, blocks kept until the connector sent them
        self.connector_prefix_cache_queries = self.connector_prefix_cache_hits = 0  # tokens asked, delivered

    def add_request(self, req: Request) -> None:
        self.requests[req.request_id] = req
        if self.config.policy == "priority":
            insort(self.waiting, req, key=_priority)
        else:
            self.waiting.append(req)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self._delayed_frees)

    def schedule(self) -> SchedulerOutput:
        """This step's batch, within max_num_batched_tokens and max_num_seqs, as the diff the
        workers need (V1's SchedulerOutput: NewRequestData the first time, CachedRequestData after).

        Changes: allocates KV blocks (prefix-cache hits on admission), moves admitted requests
        from waiting to running and preempted ones back to waiting with num_computed_tokens 0, and
        advances each scheduled request's num_computed_tokens by its scheduled tokens
        (_update_after_schedule: update_from_output takes back rejected drafts). Hooks:
        scheduler/schedule begin, PREEMPTED per preemption, the KV-cache manager's cache_hit/cache_miss,
        allocate, evict and free. The schedule's snapshot and end event come from EngineCore."""
        step = self.kv_cache_manager.step = self.num_scheduled_steps
        self.num_scheduled_steps += 1
        if self.hooks.active:
            self._trace_schedule_begin(step)
        out = SchedulerOutput(step=step, token_budget=self.config.max_num_batched_tokens,
                              finished_req_ids=self.finished_req_ids)
        self.finished_req_ids = set()
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        self._schedule_waiting(out, budget)
        self._make_diff(out)
        if self.connector is not None:  # V1's: the plan for the connector's worker side
            out.kv_connector_metadata = self.connector.build_connector_meta(out)
        self._update_after_schedule(out)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """Running requests first, in admission order; returns the budget left."""
        scheduled, spec = out.num_scheduled_tokens, out.scheduled_spec_decode_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.num_output_placeholders and self._reaches_max_tokens(req):
                i += 1  # async: a step in flight already samples its last token
                continue
            # (async scheduling: the tokens of steps in flight count, as placeholders)
            remaining = len(req.all_token_ids) + req.num_output_placeholders - req.num_computed_tokens
            n = min(remaining + len(req.spec_token_ids), budget)  # draft tokens: lookahead slots to verify
            while not self._allocate(req, n, req.num_computed_tokens + n):
                victim, why = self._victim()
                self._preempt(victim, out, reason=f"{why}no free blocks for {req.request_id}")
                if victim is req:
                    break
                if victim.request_id in scheduled:  # (priority) scheduled earlier this step: its tokens go back
                    budget += scheduled.pop(victim.request_id)
                    spec.pop(victim.request_id, None)
                    i -= 1
            else:
                drafts, req.spec_token_ids = req.spec_token_ids[:max(0, n - remaining)], []
                scheduled[req.request_id] = n
                if drafts:
                    spec[req.request_id] = drafts
                budget -= n
                i += 1
                continue
            break  # req itself was preempted
        return budget

    @staticmethod
    def _reaches_max_tokens(req: Request) -> bool:
        """V1's: the steps in flight sample its last token even if all their drafts are rejected."""
        return req.num_computed_tokens + 2 - req.num_output_placeholders >= req.num_prompt_tokens + req.max_tokens

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """Then admit waiting requests, first come first served (or by priority)."""
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
            elif (self.waiting[0].status is RequestStatus.WAITING_FOR_REMOTE_KVS
                  and not self._update_waiting_for_remote_kv(self.waiting[0])):
                skipped.append(self.waiting.popleft())  # passed over: its KV is still on its way
                continue
            else:
                head = self.waiting[0]
                reason = self._try_admit(head, budget, out)
                if head.status is RequestStatus.WAITING_FOR_REMOTE_KVS:
                    skipped.append(self.waiting.popleft())  # its KV is on its way: passed over until it arrives
                elif reason is None:
                    budget -= out.num_scheduled_tokens[out.admitted[-1]]
        if reason is not None:
            out.waiting_reasons = {r.request_id: reason for r in self.waiting}
        if skipped:
            self.waiting.extendleft(reversed(skipped))
            out.waiting_reasons |= {r.request_id: _SKIPPED_WHY[r.status] for r in skipped}

    def _make_diff(self, out: SchedulerOutput) -> None:
        """What the workers do not know yet (Model Runner V2's protocol): a request they do not hold
        comes whole (NewRequestData: new, or resumed after a preemption, which made them drop it, with
        every token to compute again); one they hold comes as its new blocks and where its tokens start
        (CachedRequestData). The workers keep the tokens they sampled."""
        cached, sent = out.scheduled_cached_reqs, self._sent_blocks
        for rid in out.num_scheduled_tokens:
            req = self.requests[rid]
            have = sent.get(rid)
            sent[rid] = tuple(map(len, req.kv_block_ids))
            if have is None:
                out.scheduled_new_reqs.append(NewRequestData(
                    rid, req.prompt_token_ids, req.params, tuple(map(list, req.kv_block_ids)), req.num_computed_tokens,
                    list(req.all_token_ids), req.eos_token_id, req.sampling_seed or 0))
                if req.num_preemptions:
                    out.resumed.append(rid)
                continue
            # a table only grows (blocks a window passed stay in the workers' copy: never read again)
            new_blocks = tuple(blocks[n:] for blocks, n in zip(req.kv_block_ids, have))
            cached.req_ids.append(rid)
            cached.new_token_ids.append([])
            cached.new_block_ids.append(new_blocks if any(new_blocks) else None)
            cached.num_computed_tokens.append(req.num_computed_tokens)
            cached.num_output_tokens.append(len(req.output_token_ids) + req.num_output_placeholders)

    def _update_after_schedule(self, out: SchedulerOutput) -> None:
        """V1's: the scheduled tokens count as computed from now on (the next step is scheduled
        against them); update_from_output takes back the drafts the model rejected."""
        requests = self.requests
        for rid, n in out.num_scheduled_tokens.items():
            req = requests[rid]
            req.num_computed_tokens += n
            req.is_prefill_chunk = req.num_computed_tokens < req.num_tokens + req.num_output_placeholders
        out.total_num_scheduled_tokens = sum(out.num_scheduled_tokens.values())

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

    def get_grammar_bitmask(self, scheduler_output: SchedulerOutput) -> GrammarOutput | None:
        """The step's grammar bitmask (V1's name; EngineCore.step calls it once the forward pass is
        under way): for each scheduled request with a grammar whose step samples a token (a chunk that
        does not end the prefill samples none), one row per position it scores: one per draft it
        verifies, then one more. None when no such request runs."""
        self.grammar_allowed_per_pos = {}
        if self.structured_output_manager is None:
            return None
        reqs = [r for r in map(self.requests.get, scheduler_output.num_scheduled_tokens) if r is not None
                and r.structured_output_request is not None and not r.is_prefill_chunk]
        if not reqs:
            return None
        t0 = time.perf_counter_ns()
        drafts = [scheduler_output.scheduled_spec_decode_tokens.get(r.request_id, []) for r in reqs]
        bitmask, allowed = self.structured_output_manager.grammar_bitmask(reqs, drafts)
        grammar_output = GrammarOutput([r.request_id for r in reqs], bitmask,
                                       [len(d) if -1 not in d else d.index(-1) for d in drafts])
        first_rows, row = {}, 0
        for r, d in zip(reqs, drafts):
            first_rows[r.request_id] = row
            self.grammar_allowed_per_pos[r.request_id] = allowed[row:row + 1 + len(d)]
            row += 1 + len(d)
        if self.hooks.active:
            self._trace_grammar_bitmask(scheduler_output.step, grammar_output, first_rows, allowed,
                                        time.perf_counter_ns() - t0)
        return grammar_output

    def _advance_grammar(self, req: Request, token_id: int, pos: int) -> None:
        """After sampling: the request's matcher accepts its token (V1's accept_tokens), the one at
        position `pos` of the step's (0 unless drafts were accepted before it)."""
        so = req.structured_output_request
        counts = self.grammar_allowed_per_pos.get(req.request_id)
        so.num_allowed.append(counts[pos] if counts else None)
        if not self.structured_output_manager.accept_token(req, token_id) and self.hooks.active:
            self._trace_grammar_rejected(req, token_id, self.step_count)

    def _trace_grammar_rejected(self, req: Request, token_id: int, step: int) -> None:
        self.hooks.emit(STRUCTURED_OUTPUT, GRAMMAR_REJECTED, request_id=req.request_id, step=step, token_id=token_id)

    def _trace_grammar_compiled(self, req: Request, step: int) -> None:
        so = req.structured_output_request
        self.hooks.emit(STRUCTURED_OUTPUT, GRAMMAR_COMPILED, request_id=req.request_id, step=step, kind=so.kind,
                        compile_s=so.compile_s, cache_hit=so.cache_hit, error=so.error,
                        waited_s=time.monotonic() - so.queued_at)

    def _trace_grammar_bitmask(self, step: int, grammar_output: GrammarOutput, first_rows: dict[str, int],
                               allowed: list[int], fill_ns: int) -> None:
        mgr, rids = self.structured_output_manager, grammar_output.structured_output_request_ids
        num_allowed = {rid: allowed[first_rows[rid]] for rid in rids}
        preview = mgr.preview(grammar_output.grammar_bitmask, first_rows, num_allowed)
        # draft positions: the mask of each (allowed tokens after 0, 1, ... of the drafts)
        per_pos = {rid: self.grammar_allowed_per_pos[rid] for rid in rids if len(self.grammar_allowed_per_pos[rid]) > 1}
        terminated = [rid for rid in rids if self.requests[rid].structured_output_request.grammar.is_terminated()]
        self.hooks.emit(STRUCTURED_OUTPUT, BITMASK, step=step, vocab_size=mgr.vocab_size, fill_ns=fill_ns,
                        num_allowed=num_allowed, allowed=preview, num_allowed_per_pos=per_pos, terminated=terminated)

    def _try_admit(self, req: Request, budget: int, out: SchedulerOutput) -> str | None:
        """Admit the head of `waiting`, or return why not. With a KV connector, the tokens it delivers
        past the prefix-cache hit count as computed (loaded in this step, or, asynchronously, before the
        request is scheduled: it then waits as WAITING_FOR_REMOTE_KVS with its blocks allocated)."""
        if any(req.kv_block_ids):  # its blocks were allocated while its remote KV arrived (WAITING_FOR_REMOTE_KVS)
            computed, num_cached, num_external, load_async = None, req.num_computed_tokens, 0, False
        else:
            computed, num_cached = self.kv_cache_manager.get_computed_blocks(req)
            num_external, load_async = 0, False
            if self.connector is not None:
                num_external, load_async = self.connector.get_num_new_matched_tokens(req, num_cached)
                if num_external is None:
                    return "the KV connector is still looking its tokens up"
                self.connector_prefix_cache_queries += req.num_tokens
                self.connector_prefix_cache_hits += num_external
        if load_async:
            return self._allocate_for_remote_kvs(req, computed, num_cached, num_external)
        n = req.num_tokens - num_cached - num_external
        if n > budget and not self.config.enable_chunked_prefill:
            return "token budget too small for the whole prompt (chunked prefill off)"
        n = min(n, budget)
        if not self._allocate(req, num_external + n, num_cached + num_external + n, computed):
            return "not enough free KV-cache blocks"
        if self.connector is not None:
            self.connector.update_state_after_alloc(req, req.kv_block_ids, num_external)
        self.waiting.popleft()
        if not req.num_computed_tokens:
            req.num_external_computed_tokens = num_external
            req.num_computed_tokens = req.num_cached_tokens = num_cached + num_external
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        out.admitted.append(req.request_id)
        out.num_scheduled_tokens[req.request_id] = n
        return None

    def _allocate_for_remote_kvs(self, req: Request, computed, num_cached: int, num_external: int) -> str | None:
        """V1's asynchronous load: blocks for the delivered tokens now, not cached until they arrive; the
        request stays in `waiting` as WAITING_FOR_REMOTE_KVS (passed over until then)."""
        if not self.kv_cache_manager.allocate_slots(req, num_external, computed, delay_cache_blocks=True):
            return "not enough free KV-cache blocks"
        self.connector.update_state_after_alloc(req, req.kv_block_ids, num_external)
        req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        req.num_external_computed_tokens = num_external
        req.num_cached_tokens = num_cached + num_external
        return None

    def _update_waiting_for_remote_kv(self, req: Request) -> bool:
        """Whether the request's remote KV has arrived; if so its blocks are cached and its delivered
        tokens computed (all but its last token: the step samples from it), and it is WAITING again."""
        if req.request_id not in self.finished_recving_kv_req_ids:
            return False
        self.finished_recving_kv_req_ids.discard(req.request_id)
        failed = [i for i, b in enumerate(req.block_ids) if b in self.failed_kv_block_ids]
        if failed:  # (V1's load errors, recompute policy) its tokens from the first failed block are computed
            self.failed_kv_block_ids.difference_update(req.block_ids)
            req.num_external_computed_tokens = 0
            req.num_cached_tokens = min(req.num_cached_tokens, failed[0] * self.kv_cache_manager.block_size)
        num_computed = min(req.num_cached_tokens, req.num_tokens - 1)
        self.kv_cache_manager.cache_blocks(req, num_computed)
        req.num_computed_tokens = num_computed
        req.status = RequestStatus.WAITING
        return True

    def _allocate(self, req: Request, n: int, end: int, computed: tuple[list[int], ...] | None = None) -> bool:
        """The KV-cache manager's allocate_slots for n more tokens of req (computed up to `end` after
        this step), and with a draft model num_lookahead_tokens slots past them when the step reaches
        req's last token (the draft then proposes from it), within max_model_len. Lookahead slots that
        do not fit are left out rather than preempting anyone for them: the draft proposes fewer."""
        bm = self.kv_cache_manager
        lookahead = 0
        if self.num_lookahead_tokens and end >= req.num_tokens + req.num_output_placeholders:
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
        self.kv_cache_manager.free(req)
        req.status = RequestStatus.PREEMPTED
        req.spec_token_ids = []
        req.num_computed_tokens = 0  # recompute: prompt and generated tokens are prefilled again
        req.num_output_placeholders = 0  # async: a step in flight still delivers its tokens (stale: counted nowhere)
        req.num_preemptions += 1
        self.num_preemptions += 1
        if self.config.policy == "priority":
            insort(self.waiting, req, key=_priority)
        else:
            self.waiting.appendleft(req)
        out.preempted.append(req.request_id)
        out.preempted_req_ids.add(req.request_id)
        self._sent_blocks.pop(req.request_id, None)  # the workers drop it: it comes back whole (NewRequestData)
        if self.hooks.active:
            self.hooks.emit(SCHEDULER, PREEMPTED, request_id=req.request_id, step=out.step, reason=reason)

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: ModelRunnerOutput | None) -> EngineCoreOutputs:
        """Apply one step's sampled tokens (None: nothing ran).

        Per scheduled request: the drafts the model rejected are taken back from
        num_computed_tokens (_update_after_schedule counted them); a chunk that does not end its
        prefill got no token; the others append theirs, are checked for EOS / stop_token_ids /
        max_tokens / max_model_len (after min_tokens), and, if finished, freed. Returns one
        EngineCoreOutput per request that got a token (no text: the front end detokenizes).
        Hooks: engine/FINISHED per finished request, after its blocks are freed. step_count + 1."""
        outputs, now = [], time.monotonic()
        for rid, error in scheduler_output.grammar_failed.items():  # finished in schedule(), never ran
            outputs.append(EngineCoreOutput(rid, [], finish_reason="abort", stop_reason=error))
        if model_runner_output is not None:
            for rid in scheduler_output.num_scheduled_tokens:
                req = self.requests.get(rid)
                if req is not None:
                    out = self._update_request(req, scheduler_output, model_runner_output, now)
                    if out is not None:
                        outputs.append(out)
            if model_runner_output.expert_load:
                self.expert_load.observe(model_runner_output.expert_load)
        kv_output = model_runner_output.kv_connector_output if model_runner_output is not None else None
        if kv_output is not None:
            self._update_from_kv_xfer_finished(kv_output)
        self.step_count += 1
        return EngineCoreOutputs(outputs=outputs)

    def _update_request(self, req: Request, sched: SchedulerOutput, mro: ModelRunnerOutput,
                        now: float) -> EngineCoreOutput | None:
        rid, step = req.request_id, sched.step
        i = mro.req_id_to_index[rid]
        generated = mro.sampled_token_ids[i]
        req.first_scheduled_time = req.first_scheduled_time or now
        drafts = sched.scheduled_spec_decode_tokens.get(rid)
        # async: preempted while this step was in flight: its tokens count, its slots were freed already
        stale = req.status is not RequestStatus.RUNNING
        if drafts and generated and not stale:  # the rejected drafts' slots were not computed after all
            rejected = len(drafts) + 1 - len(generated)
            req.num_computed_tokens -= rejected
            req.num_output_placeholders = max(0, req.num_output_placeholders - rejected)
            # V1's count: placeholders that were no draft (num_invalid_spec_tokens; -1 if never known) were not
            # proposed, and a step that verified none is no draft
            num_draft_tokens = len(drafts) - (sched.num_invalid_spec_tokens or {}).get(rid, drafts.count(-1))
            if num_draft_tokens:
                self.spec_stats.observe(num_draft_tokens, len(generated) - 1)
                if self.hooks.active:
                    self._trace_verified(req, step, drafts[:num_draft_tokens], generated)
        if not stale:  # its tokens are computed: blocks its sliding windows passed go back now, not next step
            self.kv_cache_manager.remove_skipped_blocks(req, req.num_computed_tokens - req.num_output_placeholders)
        prompt_logprobs = mro.prompt_logprobs_dict.get(rid)
        if prompt_logprobs is not None:
            _add_prompt_logprobs(req, *prompt_logprobs)
        if not generated:
            return None  # one chunk of a longer prefill: it sampled nothing
        if not stale:  # async: its placeholders are real tokens now (also those dropped at a stop)
            req.num_output_placeholders = max(0, req.num_output_placeholders - len(generated))
        new_token_ids, status = [], None
        for pos, token_id in enumerate(generated):
            req.append_token(token_id)
            new_token_ids.append(token_id)
            if req.structured_output_request is not None:
                self._advance_grammar(req, token_id, pos)
            status = check_stop(req, self.max_model_len)
            if status is not None:
                break  # the rest (accepted drafts past a stop) is dropped
        req.first_token_time = req.first_token_time or now
        if status is not None:
            req.finished_time = now
            self.finish_requests((rid,), status)
        lps = mro.logprobs[i] if mro.logprobs is not None else None
        new_logprobs = None if lps is None else [_ranked(lp, t, rank) for (lp, rank), t in zip(lps, new_token_ids)]
        if status is not None and self.hooks.active:
            self._trace_finished(req, step)
        return _output(req, new_token_ids, new_logprobs)

    def finish_requests(self, request_ids: Iterable[str], finished_status: RequestStatus) -> None:
        """Remove finished (or aborted) requests and free their blocks. Unknown or finished ids
        are ignored."""
        for rid in request_ids:
            req = self.requests.pop(rid, None)
            if req is None or req.status.finished:
                continue
            # its KV on its way: the worker still writes into its blocks (unless it has arrived already)
            receiving = (req.status is RequestStatus.WAITING_FOR_REMOTE_KVS
                         and rid not in self.finished_recving_kv_req_ids)
            self.finished_recving_kv_req_ids.discard(rid)
            req.status = finished_status
            self.finished_req_ids.add(rid)
            self._sent_blocks.pop(rid, None)
            if req in self.running:
                self.running.remove(req)
            elif req in self.waiting:
                self.waiting.remove(req)
            if self.connector is not None and self._connector_finished(req, receiving):
                continue  # its blocks are freed once the connector is done with them
            self.kv_cache_manager.free(req)

    def _connector_finished(self, req: Request, receiving: bool) -> bool:
        """V1's: the connector sees the finished request before its blocks are freed; True: it keeps
        them (until its worker side reports them sent). Its kv_transfer_params go out with its output.
        A request aborted while its KV is on its way keeps its blocks until it has arrived (the worker
        writes into them)."""
        delay, req.kv_transfer_params = self.connector.request_finished(req, list(req.block_ids))
        if delay or receiving:
            self._delayed_frees[req.request_id] = req
        return delay or receiving

    def _update_from_kv_xfer_finished(self, kv_output) -> None:
        """The workers' finished transfers: received KV makes its request schedulable, sent KV frees
        its request's blocks."""
        self.connector.update_connector_output(kv_output)
        self.finished_recving_kv_req_ids.update(kv_output.finished_recving or ())
        self.failed_kv_block_ids.update(kv_output.invalid_block_ids or ())
        for rid in kv_output.finished_recving or ():  # aborted while receiving: its blocks are free now
            req = self._delayed_frees.get(rid)
            if req is not None and req.status.finished:
                self.finished_recving_kv_req_ids.discard(rid)
                self.failed_kv_block_ids.difference_update(req.block_ids)
                self.kv_cache_manager.free(self._delayed_frees.pop(rid))
        for rid in kv_output.finished_sending or ():
            req = self._delayed_frees.pop(rid, None)
            if req is not None:
                self.kv_cache_manager.free(req)

    def _trace_schedule_begin(self, step: int) -> None:
        self.hooks.emit(SCHEDULER, SCHEDULE, BEGIN, step=step, num_waiting=len(self.waiting),
                        num_running=len(self.running))

    def update_draft_token_ids(self, draft_token_ids: DraftTokenIds) -> None:
        """The worker's proposals for the next step (vLLM V1's name): scheduled as lookahead slots.
        A request with a grammar keeps the longest prefix its grammar accepts (its matcher checks
        them and rolls back): a draft the grammar forbids could never be accepted, and the tokens
        after it are not worth verifying."""
        for rid, drafts in zip(draft_token_ids.req_ids, draft_token_ids.draft_token_ids):
            req = self.requests.get(rid)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue
            so = req.structured_output_request
            if so is not None and drafts:
                proposed, drafts = drafts, so.grammar.validate_tokens(drafts)
                if self.hooks.active:
                    self._trace_drafts_validated(req, proposed, drafts)
            req.spec_token_ids = drafts

    def update_draft_token_ids_in_output(self, draft_token_ids: DraftTokenIds,
                                         scheduler_output: SchedulerOutput) -> None:
        """Async scheduling (V1's name): a step in flight was scheduled with placeholder draft ids (-1);
        the worker put its drafts there, these. Each placeholder becomes its draft, cut (a request with a
        grammar) to the prefix its grammar accepts; the rest stay -1 and are counted in
        num_invalid_spec_tokens (also placeholders the worker had no draft for): the statistics do not
        count them as proposed, and its bitmask constrains only the drafts before them."""
        proposed = dict(zip(draft_token_ids.req_ids, draft_token_ids.draft_token_ids))
        spec, invalid = scheduler_output.scheduled_spec_decode_tokens, {}
        for rid, placeholders in spec.items():
            req = self.requests.get(rid)
            if req is None or not placeholders or placeholders[0] >= 0:
                continue  # finished, or real drafts (scheduled when they were known)
            drafts = list(proposed.get(rid, ()))[:len(placeholders)]
            so = req.structured_output_request
            if so is not None and drafts:
                checked, drafts = drafts, so.grammar.validate_tokens(drafts)
                if self.hooks.active:
                    self._trace_drafts_validated(req, checked, drafts)
            if len(drafts) < len(placeholders):
                invalid[rid] = len(placeholders) - len(drafts)
            spec[rid] = drafts + [-1] * (len(placeholders) - len(drafts))  # its length: the slots scheduled
        scheduler_output.num_invalid_spec_tokens = invalid

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


class ExpertLoadStats:
    """A mixture of experts' load since the engine started: per MoE decoder layer, the tokens each
    expert received (the per-expert load metrics vLLM users ask for; its EPLB keeps the same counts)."""

    def __init__(self):
        self.num_tokens: dict[int, list[int]] = {}

    def observe(self, expert_load: dict[int, list[int]]) -> None:
        for layer_idx, counts in expert_load.items():
            total = self.num_tokens.setdefault(int(layer_idx), [0] * len(counts))
            for e, n in enumerate(counts):
                total[e] += n


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
        if req.num_external_computed_tokens:  # a KV connector delivered them (V1's prompt-token sources)
            metrics["num_external_computed_tokens"] = req.num_external_computed_tokens
    prompt_logprobs = None
    if req.num_output_tokens == len(new_token_ids) and req.params.prompt_logprobs is not None:
        prompt_logprobs = req.prompt_logprobs
    return EngineCoreOutput(req.request_id, new_token_ids, new_logprobs, req.finish_reason, req.stop_reason,
                            req.num_cached_tokens, metrics, prompt_logprobs,
                            req.kv_transfer_params if req.finished_time is not None else None)


# why a request in `waiting` is passed over, by its status
_SKIPPED_WHY = {
    RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR:
        "its grammar is compiling (WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR)",
    RequestStatus.WAITING_FOR_REMOTE_KVS: "its KV is on its way from another instance (WAITING_FOR_REMOTE_KVS)",
}
