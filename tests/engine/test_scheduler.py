"""The scheduler alone (Scheduler + KVCacheManager + Request, no model): max_num_seqs is a hard
limit, the token budget bounds a step, long prompts are chunked, waiting requests are admitted
first come first served, and on a block shortage the newest running request is the one
preempted. ``Harness.step`` is EngineCore.step without a model: schedule(), then
update_from_output() with token 7 sampled for every scheduled request that ends its prefill
(the worker's rule: a chunk that does not samples nothing)."""
from __future__ import annotations

import pytest

from engine.config import SchedulerConfig
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.sched.output import SchedulerOutput
from engine.core.sched.scheduler import Scheduler
from engine.outputs import ModelRunnerOutput
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams

BLOCK_SIZE = 4


class Harness:
    """One scheduler over a small KV cache, and the engine's side of each step."""

    def __init__(self, num_blocks: int = 64, max_num_seqs: int = 64, max_num_batched_tokens: int = 2048,
                 enable_chunked_prefill: bool = True, num_lookahead_tokens: int = 0, max_model_len: int = 1024):
        self.kv_cache_manager = KVCacheManager(num_blocks, BLOCK_SIZE, enable_caching=False)
        config = SchedulerConfig(max_num_seqs, max_num_batched_tokens, enable_chunked_prefill)
        self.scheduler = Scheduler(config, self.kv_cache_manager, max_model_len=max_model_len,
                                   num_lookahead_tokens=num_lookahead_tokens)
        self.num_added = 0

    def add(self, num_prompt_tokens: int, max_tokens: int = 8) -> Request:
        rid, self.num_added = f"r{self.num_added}", self.num_added + 1
        req = Request(rid, None, list(range(1, num_prompt_tokens + 1)),
                      SamplingParams(max_tokens=max_tokens, ignore_eos=True), None, max_tokens)
        self.scheduler.add_request(req)
        return req

    def schedule(self) -> SchedulerOutput:
        return self.scheduler.schedule()

    def step(self) -> SchedulerOutput:
        """One engine step with no model: every scheduled request samples token 7."""
        out = self.schedule()
        self.scheduler.update_from_output(out, self.runner_output(out) if not out.is_empty else None)
        return out

    def runner_output(self, out: SchedulerOutput, kept: dict[str, list[int]] | None = None) -> ModelRunnerOutput:
        """Token 7 for each request whose computed tokens reach its last (kept: a verification's tokens)."""
        reqs = [self.scheduler.requests[rid] for rid in out.num_scheduled_tokens]
        sampled = [(kept or {}).get(r.request_id, [7]) if r.num_computed_tokens >= r.num_tokens else [] for r in reqs]
        return ModelRunnerOutput(out.req_ids, {rid: i for i, rid in enumerate(out.req_ids)}, sampled)


def ids(out: SchedulerOutput) -> list[str]:
    return out.req_ids


def only(out: SchedulerOutput) -> tuple[int, int]:
    """The one scheduled request: (where its tokens start, how many)."""
    (row,) = [(rid, n) for rid, n in out.num_scheduled_tokens.items()]
    start = out.num_computed_before()[row[0]]
    return start, row[1]


def test_max_num_seqs_is_a_hard_limit():
    h = Harness(max_num_seqs=2)
    a, b, c = h.add(3), h.add(3), h.add(3)
    out = h.step()
    assert ids(out) == [a.request_id, b.request_id] and out.admitted == [a.request_id, b.request_id]
    assert out.waiting_reasons == {c.request_id: "max_num_seqs reached"}
    assert list(h.scheduler.waiting) == [c] and c.status is RequestStatus.WAITING
    for _ in range(3):  # decoding: still two, while both run
        out = h.step()
        assert len(out.req_ids) == 2 and out.waiting_reasons == {c.request_id: "max_num_seqs reached"}


def test_the_token_budget_bounds_a_step():
    h = Harness(max_num_batched_tokens=10, enable_chunked_prefill=False)
    a, b = h.add(6), h.add(6)
    out = h.step()
    assert ids(out) == [a.request_id] and out.total_num_scheduled_tokens == 6 and out.token_budget == 10
    assert out.waiting_reasons == {b.request_id: "token budget too small for the whole prompt (chunked prefill off)"}
    out = h.step()  # a decodes (1 token), b's whole prompt fits beside it
    assert out.num_scheduled_tokens == {a.request_id: 1, b.request_id: 6}

    h = Harness(max_num_batched_tokens=10)  # chunked prefill: b takes what is left of the budget
    a, b, c = h.add(6), h.add(6), h.add(2)
    out = h.step()
    assert out.num_scheduled_tokens == {a.request_id: 6, b.request_id: 4}
    assert out.waiting_reasons == {c.request_id: "token budget used up"}
    out = h.step()
    assert out.num_scheduled_tokens == {a.request_id: 1, b.request_id: 2, c.request_id: 2}


def test_a_long_prompt_is_chunked_across_steps():
    h = Harness(max_num_batched_tokens=8)
    req = h.add(21)
    chunks = []
    while req.num_output_tokens == 0:
        out = h.step()
        start, n = only(out)
        assert start == sum(chunks) and (req.num_output_tokens == 0) == (start + n < 21)
        chunks.append(n)
    assert chunks == [8, 8, 5]
    out = h.step()
    assert only(out) == (21, 1) and [n.req_id for n in out.scheduled_new_reqs] == []
    assert out.scheduled_cached_reqs.req_ids == [req.request_id] and req.num_computed_tokens == 22


def test_waiting_requests_are_admitted_first_come_first_served():
    h = Harness(max_num_batched_tokens=64)
    reqs = [h.add(n) for n in (5, 1, 9, 2)]
    assert h.step().admitted == [r.request_id for r in reqs]

    h = Harness(num_blocks=1 + 4)  # 4 usable blocks of 4 tokens
    first, second, third = h.add(12), h.add(8), h.add(2)  # 3 blocks; then 2 (1 is free); then 1 (it would fit)
    out = h.step()
    assert out.admitted == [first.request_id]  # third does not overtake second
    assert list(h.scheduler.waiting) == [second, third]
    assert out.waiting_reasons == {second.request_id: "not enough free KV-cache blocks",
                                   third.request_id: "not enough free KV-cache blocks"}


def test_the_scheduler_output_is_a_diff():
    """A request comes whole the first time (NewRequestData), then as its new blocks and where its
    tokens start (CachedRequestData); a preempted one is named (the workers drop it), and comes back
    whole (Model Runner V2's protocol), with its whole new block table and every token to compute
    again; a finished one is named once. num_computed_tokens advances at schedule."""
    h = Harness(num_blocks=1 + 4, max_num_seqs=2, max_num_batched_tokens=64)
    old, new = h.add(7, max_tokens=16), h.add(7, max_tokens=16)
    out = h.step()
    prompt = list(range(1, 8))
    assert [(n.req_id, n.num_computed_tokens, n.block_ids, n.prefill_token_ids) for n in out.scheduled_new_reqs] == [
        (old.request_id, 0, (old.block_ids,), prompt), (new.request_id, 0, (new.block_ids,), prompt)]
    out = h.schedule()
    c = out.scheduled_cached_reqs
    assert not out.scheduled_new_reqs and c.req_ids == [old.request_id, new.request_id]
    assert c.num_computed_tokens == [7, 7] and c.new_block_ids == [None, None]  # position 7 fits their 2nd block
    assert old.num_computed_tokens == 8 and out.total_num_scheduled_tokens == 2  # _update_after_schedule
    h.scheduler.update_from_output(out, h.runner_output(out))
    while not out.preempted_req_ids:
        out = h.step()
    assert out.preempted_req_ids == {new.request_id}
    while new.request_id not in out.num_scheduled_tokens:
        h.scheduler.finish_requests([old.request_id], RequestStatus.FINISHED_ABORTED)
        out = h.step()
    c = out.scheduled_cached_reqs
    assert out.finished_req_ids == {old.request_id} and not c.req_ids and not c.resumed_req_ids
    [again] = out.scheduled_new_reqs
    assert (again.req_id, again.num_computed_tokens, again.block_ids) == (new.request_id, 0, (new.block_ids,))
    # its prompt and what it generated before the preemption (h.step() appended this step's token since)
    assert again.prefill_token_ids == new.all_token_ids[:-1] and len(again.prefill_token_ids) > len(prompt)


def test_update_from_output_takes_back_rejected_drafts():
    h = Harness()
    a = h.add(5, max_tokens=20)
    h.step()
    a.spec_token_ids = [3, 4, 5]
    out = h.schedule()
    assert a.num_computed_tokens == 6 + 3  # the last token and 3 drafts, counted at schedule time
    h.scheduler.update_from_output(out, h.runner_output(out, kept={a.request_id: [3, 9]}))  # 1 accepted
    assert a.num_computed_tokens == 7 and a.all_token_ids[-3:] == [7, 3, 9]
    assert h.scheduler.spec_stats.num_accepted_tokens == 1


def test_on_a_block_shortage_the_newest_running_request_is_preempted():
    h = Harness(num_blocks=1 + 4, max_num_seqs=2, max_num_batched_tokens=64)  # 4 usable blocks of 4 tokens
    old, new = h.add(7, max_tokens=16), h.add(7, max_tokens=16)  # 2 blocks each: all 4 taken
    later = h.add(3)
    out = h.step()
    assert out.admitted == [old.request_id, new.request_id] and h.kv_cache_manager.num_free_blocks == 0
    out = h.step()  # 8 tokens each now: the next token needs a fifth block
    while not out.preempted:
        out = h.step()
    assert out.preempted == [new.request_id] and ids(out) == [old.request_id]
    assert new.status is RequestStatus.PREEMPTED and new.num_computed_tokens == 0 and new.block_ids == []
    assert new.num_preemptions == 1 and h.scheduler.num_preemptions == 1
    assert list(h.scheduler.waiting) == [new, later] and h.scheduler.running == [old]  # new goes back first
    assert out.waiting_reasons == {new.request_id: "preemption this step", later.request_id: "preemption this step"}


@pytest.mark.parametrize("max_num_seqs", [1, 3])
def test_every_request_finishes_and_every_block_comes_back(max_num_seqs):
    h = Harness(num_blocks=1 + 8, max_num_seqs=max_num_seqs, max_num_batched_tokens=12)
    reqs = [h.add(n, max_tokens=5) for n in (9, 3, 14, 5, 1)]
    for _ in range(200):
        if not h.scheduler.has_unfinished_requests():
            break
        out = h.step()
        assert len(h.scheduler.running) <= max_num_seqs and out.total_num_scheduled_tokens <= 12
    assert all(r.status is RequestStatus.FINISHED_LENGTH and r.num_output_tokens == 5 for r in reqs)
    assert h.kv_cache_manager.num_free_blocks == h.kv_cache_manager.num_usable_blocks


def test_lookahead_slots_for_a_draft_model():
    """With a draft model (V1's num_lookahead_tokens) a step that reaches a request's last token
    reserves k slots past it, where the draft writes its proposals; a prefill chunk that does not
    reach it reserves none, none are reserved past max_model_len, and none that do not fit."""
    h = Harness(max_num_batched_tokens=8, num_lookahead_tokens=3, max_model_len=24)
    a = h.add(10, max_tokens=20)
    h.step()  # a chunk of 8 of its 10 prompt tokens: 2 blocks, no lookahead
    assert len(a.block_ids) == 2
    h.step()  # the rest of the prompt (10 tokens) + 3 lookahead slots: 13 -> 4 blocks
    assert len(a.block_ids) == 4 and a.num_computed_tokens == 10 and a.num_tokens == 11
    a.spec_token_ids = [7, 7]  # drafts to verify: 1 + 2 tokens scheduled, 3 more slots past them
    out = h.schedule()
    assert out.num_scheduled_tokens[a.request_id] == 3 and len(a.block_ids) * BLOCK_SIZE >= 10 + 3 + 3
    assert out.scheduled_spec_decode_tokens == {a.request_id: [7, 7]}
    h.scheduler.update_from_output(out, h.runner_output(out, kept={a.request_id: [7, 7, 7]}))
    while a.num_tokens < 23:  # near max_model_len the lookahead stops at it
        h.step()
    assert len(a.block_ids) * BLOCK_SIZE == 24
    plain = Harness(max_num_batched_tokens=8)
    b = plain.add(10, max_tokens=20)
    plain.step()
    plain.step()
    assert len(b.block_ids) == 3  # no draft model: 11 slots' worth, no more
    # lookahead slots that do not fit are left out (the draft proposes fewer), never a reason to wait
    tight = Harness(num_blocks=4, num_lookahead_tokens=3)  # 3 usable blocks: 12 slots
    c = tight.add(10, max_tokens=2)
    out = tight.step()
    assert ids(out) == [c.request_id] and len(c.block_ids) == 3
    tight.step()
    assert c.status is RequestStatus.FINISHED_LENGTH
