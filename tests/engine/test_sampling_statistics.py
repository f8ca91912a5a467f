"""Sampling proven by statistics: speculative decoding's rejection sampler and the Gumbel-max sampler
draw from exactly the target's distribution (vLLM's test_rejection_sampling_approximates_target_distribution).

Setup: a vocabulary of V = 8 tokens; for k = 1 .. 4 drafts, random target distributions p_0 .. p_k
(one per position, the last the bonus token's) and proposer distributions q_0 .. q_{k-1}: a point
mass (n-gram drafts, greedy draft-model drafts) or a full q (a sampled draft model: q is p mixed
with noise, so drafts are often, not always, right). Each trial is one request with its own seed;
its drafts are drawn from q. Emitted position j (reached when drafts 0 .. j-1 were accepted) must
be distributed as p_j: the acceptance uniform, the recovered token and the bonus token at
position j depend only on (seed, j), so reaching j tells nothing about position j itself.

The bound: Pearson's chi-square of the emitted counts at every position against p_j, below
24.32 (7 degrees of freedom, p = 0.001) at every position. The seed is fixed, so the test is
deterministic. Measured (N = 4000 trials per k; the largest chi-square over the positions, for
k = 1, 2, 3, 4): the correct sampler 5.9, 5.5, 11.9, 13.6 with a point q and 4.0, 11.3, 11.1, 10.0
with a full q. The Triton walk runs on the first 60 trials (interpreted on a CPU) and must give the
reference's output exactly.

Negative controls, parametrised below so the suite shows them failing (N / 2 trials): a recovered
token drawn from p itself, the draft not removed from the residual: 272, 497, 205, 396 (point q) and
22.6, 21.4, 56.7, 53.8 (full q, where q removes only part of the draft's mass); an acceptance with
the inverted ratio q / p instead of p / q (every point-mass draft accepted): 10326, 10921, 11908, 8436
(point q) and 545, 3120, 2044, 2281 (full q). The Gumbel sampler: the correct one 11.9 (plain), 5.3
(temperature 0.7), 2.0 (top-k 5 and top-p 0.9); with exponential noise instead of Gumbel, 92.8.
"""
from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
from engine.sample import sampler as sampler_module
from engine.sample.rejection_sampler import RejectionSampler, requests_after_drafts, sample_recovered_tokens
from engine.sample.sampler import Sampler, processed_probs
from kernels import gumbel_sample_ref, rand_ref, rejection_sample, rejection_sample_ref

V, N, BOUND = 8, 4000, 24.32  # vocabulary, trials per k, chi-square bound (df 7, p = 0.001)


def _target(k: int, full_q: bool, seed: int):
    """p [k + 1, V], q [k, V] (None: point mass), drafts [N, k], per-trial seeds [N]."""
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(1.5 * torch.randn(k + 1, V, generator=g), -1)
    if full_q:
        q = 0.6 * p[:k] + 0.4 * torch.softmax(torch.randn(k, V, generator=g), -1)
        drafts = torch.stack([torch.multinomial(q[j], N, replacement=True, generator=g) for j in range(k)], 1)
    else:  # an n-gram guess: the target's second most likely token, the same in every trial
        q, drafts = None, p[:k].argsort(-1, descending=True)[:, 1].expand(N, k).contiguous()
    seeds = torch.randint(-2 ** 62, 2 ** 62, (N,), generator=g)
    return p, q, drafts, seeds


def _recovered_keeping_the_draft(probs, draft_ids, seeds, positions, draft_probs=None, backend="torch"):
    """BROKEN: the recovered token drawn from p, the rejected draft not removed from the residual."""
    return gumbel_sample_ref(torch.log(probs), torch.from_numpy(seeds), torch.tensor(positions), 2).tolist()


def _speculate(p, q, drafts, seeds, walk=rejection_sample_ref, recovered=sample_recovered_tokens, invert=False):
    """One step per trial: the acceptance walk's output [trials, k + 1], built from the engine's pieces
    (acceptance uniforms and recovered tokens keyed by (seed, position), the bonus token's Gumbel draw)."""
    n, k = drafts.shape
    pos = torch.arange(k).expand(n, k).reshape(-1)
    row_seeds = seeds[:, None].expand(n, k).reshape(-1)
    flat = drafts.reshape(-1)
    rows_p = p[:k].repeat(n, 1)
    target_probs = rows_p[torch.arange(n * k), flat]
    draft_probs = torch.ones(n * k) if q is None else q.repeat(n, 1)[torch.arange(n * k), flat]
    if invert:  # BROKEN: accept with probability q / p
        target_probs, draft_probs = draft_probs, target_probs
    rec = recovered(rows_p, flat.tolist(), row_seeds.numpy(), pos.tolist(),
                    None if q is None else q.repeat(n, 1))
    bonus = gumbel_sample_ref(torch.log(p[k]).expand(n, V), seeds, torch.full((n,), k))
    return walk(draft_token_ids=flat, cu_num_drafts=torch.arange(0, n * k + 1, k),
                target_argmax=torch.zeros(n * k, dtype=torch.int64), target_probs=target_probs,
                draft_probs=draft_probs, uniform=rand_ref(row_seeds, pos, stream=1),
                recovered_token_ids=torch.tensor(rec), bonus_token_ids=bonus,
                is_greedy=torch.zeros(n, dtype=torch.bool), max_drafts=k)


def chi_square(tokens: torch.Tensor, p: torch.Tensor) -> float:
    """Pearson's statistic of the emitted tokens (-1: not emitted) against p."""
    tokens = tokens[tokens >= 0]
    counts = torch.bincount(tokens, minlength=len(p)).double()
    expected = len(tokens) * p.double()
    assert counts[p == 0].sum() == 0, "a token the target never draws was emitted"
    keep = p > 0
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def worst_chi_square(out: torch.Tensor, p: torch.Tensor) -> float:
    return max(chi_square(out[:, j], p[j]) for j in range(p.shape[0]))


@pytest.mark.parametrize("full_q", [False, True], ids=["point_q", "full_q"])
@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_rejection_sampling_keeps_the_target_distribution(k, full_q):
    p, q, drafts, seeds = _target(k, full_q, seed=k)
    out = _speculate(p, q, drafts, seeds)
    assert worst_chi_square(out, p) < BOUND
    assert (out[:, 0] == drafts[:, 0]).any() and (out[:, 0] != drafts[:, 0]).any()  # both branches taken
    # the Triton walk: the same output on the same inputs (interpreted on a CPU: 60 trials)
    few = slice(0, 60)
    device = "cuda" if torch.cuda.is_available() else "cpu"

    def triton_walk(**kw):
        return rejection_sample(**{a: v.to(device) if isinstance(v, torch.Tensor) else v for a, v in kw.items()}).cpu()

    assert torch.equal(_speculate(p, q, drafts[few], seeds[few], walk=triton_walk), out[few])


@pytest.mark.parametrize("full_q", [False, True], ids=["point_q", "full_q"])
@pytest.mark.parametrize("broken", ["residual_keeps_the_draft", "inverted_ratio"])
def test_a_broken_rejection_sampler_fails_the_bound(broken, full_q):
    """Negative controls: the same test catches each broken sampler (numbers in the module docstring)."""
    worst = 0.0
    for k in (1, 2, 3, 4):
        p, q, drafts, seeds = _target(k, full_q, seed=k)
        drafts, seeds = drafts[:N // 2], seeds[:N // 2]  # half the trials: enough to fail by far
        out = _speculate(p, q, drafts, seeds, recovered=_recovered_keeping_the_draft) \
            if broken == "residual_keeps_the_draft" else _speculate(p, q, drafts, seeds, invert=True)
        worst = max(worst, worst_chi_square(out, p))
    assert worst > BOUND


class _Row:
    """A request as the sampler reads it."""

    def __init__(self, rid: str, seed: int, params: SamplingParams, prompt: list[int]):
        self.request_id, self.params, self.sampling_seed, self.eos_token_id = rid, params, seed, None
        self.output_token_ids, self.all_token_ids = [], list(prompt)


def _engine_speculation(k: int, params: SamplingParams, n: int = 3000) -> tuple[torch.Tensor, torch.Tensor]:
    """(emitted tokens [n, k + 1], the processed target [k + 1, V]) of the engine's RejectionSampler with
    point-mass drafts, as the model runner calls it, and its sampler's bonus draw."""
    p, _, drafts, seeds = _target(k, False, seed=10 + k)
    rows = [_Row(f"r{i}", int(s), params, [0, 1, 2]) for i, s in enumerate(seeds[:n].tolist())]
    sampler = Sampler()
    logits, d = torch.log(p), drafts[:n].tolist()
    bonus = sampler(logits[k].expand(n, V), requests_after_drafts(rows, d)).token_ids
    kept = RejectionSampler(sampler=sampler)(logits[:k].repeat(n, 1), d, rows, bonus)
    out = torch.full((n, k + 1), -1)
    for i, toks in enumerate(kept):
        out[i, :len(toks)] = torch.tensor(toks)
    col = [torch.tensor([[float(v)]]).expand(k + 1, 1) for v in (params.temperature, params.min_p)]
    col += [torch.tensor([[max(params.top_k, 0)]]).expand(k + 1, 1), torch.tensor([[params.top_p]]).expand(k + 1, 1)]
    return out, TARGET_PROBS(logits, *col)


TARGET_PROBS = processed_probs  # the sampler's processing, as it is when the module loads
SETTINGS = {"plain": SamplingParams(temperature=1.0), "top_p": SamplingParams(temperature=1.5, top_p=0.7)}


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("k", [1, 3])
def test_engine_rejection_sampler_keeps_the_target_distribution(k, setting):
    """Every emitted position is distributed as the target's, the sampler's processing (temperature,
    top-p) applied. Measured (k = 1, 3): plain 6.1, 15.5; top-p 3.3, 10.5."""
    out, target = _engine_speculation(k, SETTINGS[setting])
    assert worst_chi_square(out, target) < BOUND


def test_top_p_without_renormalising_fails_the_bound(monkeypatch):
    """Negative control: p(draft) read from top-p's cut distribution without dividing by its kept mass
    accepts drafts too rarely. Measured (k = 1, 3): 66.6, 57.3."""
    def unnormalised(logits, temperature, min_p, top_k, top_p):
        probs = torch.softmax(logits / temperature, -1)
        sorted_p, order = probs.sort(-1, descending=True)
        return probs.scatter(-1, order, sorted_p.masked_fill((sorted_p.cumsum(-1) - sorted_p) >= top_p, 0.0))

    monkeypatch.setattr(sampler_module, "processed_probs", unnormalised)
    assert max(worst_chi_square(*_engine_speculation(k, SETTINGS["top_p"])) for k in (1, 3)) > BOUND


def _gumbel_draws(p: torch.Tensor, n: int, params: SamplingParams, broken: bool = False) -> torch.Tensor:
    """n requests, each its own seed, one draw each from logits log p (the sampler's processing applied)."""
    seeds = torch.randint(-2 ** 62, 2 ** 62, (n,), generator=torch.Generator().manual_seed(7))
    rows = [_Row(f"g{i}", int(s), params, [5] * (i % 5 + 1)) for i, s in enumerate(seeds.tolist())]
    sampler = Sampler()
    if broken:  # BROKEN: exponential noise -log(u) added to the logits instead of Gumbel noise
        def draw(logits, slots, positions, stream=0):
            keys = torch.from_numpy(sampler.states.seeds[slots])[:, None]
            u = rand_ref(keys, torch.tensor(positions)[:, None] * V + torch.arange(V), stream=0)
            return (logits - torch.log(u)).argmax(-1).tolist()
        sampler.gumbel = draw
    return torch.tensor(sampler(torch.log(p).expand(n, V), rows).token_ids)


@pytest.mark.parametrize("setting", ["plain", "temperature", "top_k_top_p"])
def test_gumbel_sampler_draws_the_target_distribution(setting):
    """Issue 47's test for the MRv2 sampler: N requests with their own seeds, one draw each; the
    counts against the processed target (temperature, top-k, top-p applied)."""
    p = torch.softmax(1.5 * torch.randn(V, generator=torch.Generator().manual_seed(3)), -1)
    params = {"plain": SamplingParams(temperature=1.0), "temperature": SamplingParams(temperature=0.7),
              "top_k_top_p": SamplingParams(temperature=1.0, top_k=5, top_p=0.9)}[setting]
    col = [torch.tensor([[v]]) for v in (params.temperature, params.min_p, max(params.top_k, 0), params.top_p)]
    target = processed_probs(torch.log(p)[None], *col)[0]
    assert chi_square(_gumbel_draws(p, N, params), target) < BOUND


def test_a_broken_gumbel_sampler_fails_the_bound():
    p = torch.softmax(1.5 * torch.randn(V, generator=torch.Generator().manual_seed(3)), -1)
    assert chi_square(_gumbel_draws(p, N, SamplingParams(temperature=1.0), broken=True), p) > 2 * BOUND  # 92.8


def test_draws_are_keyed_by_seed_and_position_only():
    """The same (seed, position) draws the same token whatever the batch; another position another draw."""
    p = torch.softmax(torch.randn(V, generator=torch.Generator().manual_seed(1)), -1)
    params = SamplingParams(temperature=1.0)
    alone = Sampler()(torch.log(p)[None], [_Row("a", 42, params, [1, 2])]).token_ids
    crowd = [_Row(f"c{i}", i, params, [3] * i) for i in range(1, 9)]
    batch = Sampler()(torch.log(p).expand(9, V), crowd[:4] + [_Row("a", 42, params, [1, 2])] + crowd[4:]).token_ids
    assert batch[4] == alone[0]
    many = {Sampler()(torch.log(p)[None], [_Row("a", 42, params, [1] * n)]).token_ids[0] for n in range(1, 40)}
    assert len(many) > 3
