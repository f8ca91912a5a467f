"""Every request has a seed, and its draws are keyed by (seed, position) (vLLM 0.33's Model Runner V2): the
same tokens alone, in any batch, across a preemption; the seed is in the trace's QUEUED event; the
Triton draw equals its reference."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.hooks import Hooks
from engine.sample.rejection_sampler import RejectionSampler
from engine.sample.sampler import Sampler
from engine.trace_names import PREEMPTED, QUEUED

PROMPT = "The default value of this argument is"
SEEDED = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=1234, max_tokens=24, ignore_eos=True)
OTHERS = ["Return a new list", "The module provides", "1 2 3", "class Foo:", "import os"]


def _listen(hooks: Hooks) -> list:
    events = []
    hooks.subscribe(lambda layer, name, kind, rid, step, attrs: events.append((name, rid, attrs)))
    return events


@pytest.mark.slow
def test_seeded_tokens_alone_in_any_batch_and_across_preemption():
    roomy = LLM("tiny-gpt2", num_kv_blocks=256)
    alone = roomy.generate(PROMPT, SEEDED, use_tqdm=False)[0].outputs[0].token_ids
    for order in (OTHERS[:2] + [PROMPT] + OTHERS[2:], [PROMPT] + OTHERS[::-1]):
        params = [SEEDED if p == PROMPT else SamplingParams(temperature=1.0, max_tokens=8 + i, ignore_eos=True)
                  for i, p in enumerate(order)]
        outs = roomy.generate(order, params, use_tqdm=False)
        assert outs[order.index(PROMPT)].outputs[0].token_ids == alone
    hooks = Hooks()
    events = _listen(hooks)
    # 4 blocks of 16 tokens cannot hold both (3 blocks and 2): the newest, the seeded one, is preempted
    tight = LLM("tiny-gpt2", num_kv_blocks=4, block_size=16, hooks=hooks)
    outs = tight.generate([OTHERS[0], PROMPT], [SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True),
                                                SEEDED], use_tqdm=False)
    assert outs[1].outputs[0].token_ids == alone
    assert any(name == PREEMPTED and rid == outs[1].request_id for name, rid, _ in events), "it was preempted"


def test_every_request_gets_a_seed_reported_when_queued():
    hooks = Hooks()
    events = _listen(hooks)
    llm = LLM("tiny-gpt2", num_kv_blocks=64, hooks=hooks)
    llm.generate(OTHERS[:3], [SamplingParams(max_tokens=2), SamplingParams(max_tokens=2, seed=5),
                              SamplingParams(max_tokens=2)], use_tqdm=False)
    seeds = [attrs["seed"] for name, _, attrs in events if name == QUEUED]
    assert len(seeds) == 3 and seeds[1] == 5 and all(isinstance(s, int) for s in seeds)
    assert len(set(seeds)) == 3  # the unseeded ones drew their own


class _Row:
    def __init__(self, rid: str, seed: int, params: SamplingParams, prompt: list[int], output=()):
        self.request_id, self.params, self.sampling_seed, self.eos_token_id = rid, params, seed, 0
        self.output_token_ids, self.all_token_ids = list(output), list(prompt) + list(output)


def _rows() -> list[_Row]:
    settings = [dict(temperature=0.0), dict(temperature=1.0), dict(temperature=0.7, top_k=20),
                dict(temperature=1.2, top_p=0.8, presence_penalty=0.5), dict(temperature=1.0, min_p=0.1),
                dict(temperature=0.9, min_tokens=3, logit_bias={3: 4.0})]
    return [_Row(f"r{i}", 1000 + i, SamplingParams(**kw), [1, 2, 3 + i], output=[4] * i)
            for i, kw in enumerate(settings)]


def test_triton_sampler_equals_the_reference():
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(0)) * 2
    rows = _rows()
    assert Sampler("triton")(logits, rows).token_ids == Sampler("torch")(logits, rows).token_ids


def test_triton_rejection_sampler_equals_the_reference():
    g = torch.Generator().manual_seed(1)
    rows = _rows()
    drafts = [[5, 6], [int(t) for t in torch.randint(0, 300, (3,), generator=g)], [7], [8, 9, 10], [11], [3, 3]]
    logits = torch.randn(sum(map(len, drafts)), 300, generator=g)
    for i, d in enumerate(drafts):  # make some drafts likely, so both branches are taken
        start = sum(map(len, drafts[:i]))
        logits[start, d[0]] += 6.0 * (i % 2)
    bonus = list(range(len(rows)))
    kept = {backend: RejectionSampler(backend)(logits, drafts, rows, bonus) for backend in ("torch", "triton")}
    assert kept["torch"] == kept["triton"]
    assert any(len(k) > 1 for k in kept["torch"]) and any(k[-1] not in bonus for k in kept["torch"])


def test_the_slots_are_reused_and_a_reused_id_gets_its_own_settings():
    sampler = Sampler()
    a = _Row("a", 1, SamplingParams(temperature=1.0), [1])
    sampler(torch.zeros(1, 10), [a])
    slot = sampler.states.req_id_to_index["a"]
    assert sampler.states.seeds[slot] == 1
    sampler.finish_requests(["a"])
    b = _Row("a", 2, SamplingParams(temperature=0.0), [1])  # the same id, a new request
    sampler(torch.zeros(1, 10), [b])
    assert sampler.states.seeds[sampler.states.req_id_to_index["a"]] == 2
    assert np.count_nonzero([p is not None for p in sampler.states.params]) == 1
