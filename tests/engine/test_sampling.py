import math

import torch

from engine import SamplingParams
from engine.request import Request
from engine.sample.sampler import Sampler, argmax


def test_seeded_request_same_alone_and_in_batch_of_8(llm):
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=20, ignore_eos=True)
    alone = llm.generate("Seeded sampling", params, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, seed=i, max_tokens=10 + i, ignore_eos=True) for i in range(7)]
    batch = llm.generate([f"other prompt {i}" * (i + 1) for i in range(3)] + ["Seeded sampling"]
                         + [f"x{i}" for i in range(4)], others[:3] + [params] + others[3:], use_tqdm=False)
    assert batch[3].outputs[0].token_ids == alone
    # and it really samples: another seed gives another sequence
    other = llm.generate("Seeded sampling", SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=99,
                                                           max_tokens=20, ignore_eos=True), use_tqdm=False)
    assert other[0].outputs[0].token_ids != alone


def _req(params, prompt=(1, 2, 3), outputs=(), rid="r", seed=0):
    r = Request(rid, None, list(prompt), params, None, 10)
    for t in outputs:
        r.append_token(t)
    r.sampling_seed = seed
    return r


def _draws(params, logits, n=400):
    """n requests with their own seeds, one draw each (a request's draw at one position is fixed by its seed)."""
    reqs = [_req(params, rid=f"r{i}", seed=i) for i in range(n)]
    return set(Sampler()(logits.expand(n, -1), reqs).token_ids)


def test_top_k_top_p_min_p_filter_the_distribution():
    logits = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.06, 0.04]))
    assert _draws(SamplingParams(temperature=1.0, top_k=2), logits) == {0, 1}
    # top_p=0.65: 0.4 + 0.3 reaches it; the 0.2 token is outside the nucleus
    assert _draws(SamplingParams(temperature=1.0, top_p=0.65), logits) == {0, 1}
    # min_p=0.4: keep tokens with p >= 0.4 * 0.4 = 0.16
    assert _draws(SamplingParams(temperature=1.0, min_p=0.4), logits) == {0, 1, 2}
    assert _draws(SamplingParams(temperature=1.0), logits) == {0, 1, 2, 3, 4}


def test_argmax_matches_torch_first_index_on_ties():
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(0))
    logits[2, 7] = logits[2, 200] = logits[2].max() + 1  # a tie: the first index wins, as in torch
    logits[4, 50] = float("nan")  # NaN counts as the largest, as in torch
    assert argmax(logits) == logits.argmax(dim=-1).tolist()
    assert argmax(logits)[2] == 7 and argmax(logits)[4] == 50
    assert argmax(logits[3]) == int(logits[3].argmax())


def test_one_batch_mixes_greedy_penalised_and_sampled_requests():
    """Each request is sorted into greedy / penalised / sampled independently of its neighbours."""
    logits = torch.tensor([[2.0, 1.9, -1.0, 0.5]] * 3)
    reqs = [_req(SamplingParams(temperature=0), rid="a"),
            _req(SamplingParams(temperature=0, presence_penalty=0.2), outputs=[0], rid="b"),
            _req(SamplingParams(temperature=1.0, top_k=1, seed=3), rid="c")]
    assert Sampler()(logits, reqs).token_ids == [0, 1, 0]


def test_greedy_and_penalties():
    sampler = Sampler()
    logits = torch.tensor([[2.0, 1.9, -1.0, 0.5]])
    assert sampler(logits, [_req(SamplingParams(temperature=0))]).token_ids == [0]
    # token 0 was generated twice: frequency 0.1*2 + presence 0.0 -> 1.8 < 1.9
    r = _req(SamplingParams(temperature=0, frequency_penalty=0.1), outputs=[0, 0])
    assert sampler(logits, [r]).token_ids == [1]
    r = _req(SamplingParams(temperature=0, presence_penalty=0.2), outputs=[0])
    assert sampler(logits, [r]).token_ids == [1]
    # repetition penalty divides positive logits of seen tokens (prompt included)
    r = _req(SamplingParams(temperature=0, repetition_penalty=1.2), prompt=[0])
    assert sampler(logits, [r]).token_ids == [1]


def test_logprobs_are_of_the_raw_distribution(llm):
    out = llm.generate("logprobs", SamplingParams(temperature=0, max_tokens=3, logprobs=5, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 3
    for tok, entry in zip(out.token_ids, out.logprobs):
        assert tok in entry and entry[tok].rank == 1  # greedy picks the top token
        assert len(entry) == 5
        assert all(lp.logprob <= 0 for lp in entry.values())
        assert sum(math.exp(lp.logprob) for lp in entry.values()) <= 1.0 + 1e-5
        ranks = sorted(lp.rank for lp in entry.values())
        assert ranks == [1, 2, 3, 4, 5]
