"""The rejection sampler's kernel against its reference, and the statistics of the rule: speculative
sampling leaves the output distribution exactly the target's."""
import pytest
import torch

from kernels import rejection_sample, rejection_sample_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # compiled there, interpreted here


def _on_device(case: dict) -> dict:
    return {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in case.items()}


def _case(seed: int, num_reqs: int = 5, max_drafts: int = 4, vocab: int = 7):
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, max_drafts + 1, (num_reqs,), generator=g)
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
    n = int(cu[-1])
    drafts = torch.randint(0, vocab, (n,), generator=g)
    argmax = torch.where(torch.rand(n, generator=g) < 0.6, drafts, torch.randint(0, vocab, (n,), generator=g))
    return dict(draft_token_ids=drafts, cu_num_drafts=cu, target_argmax=argmax,
                target_probs=torch.rand(n, generator=g), draft_probs=torch.ones(n),
                uniform=torch.rand(n, generator=g), recovered_token_ids=torch.randint(0, vocab, (n,), generator=g),
                bonus_token_ids=torch.randint(0, vocab, (num_reqs,), generator=g),
                is_greedy=torch.rand(num_reqs, generator=g) < 0.5, max_drafts=max_drafts)


@pytest.mark.parametrize("seed", range(6))
def test_kernel_equals_reference(seed):
    case = _case(seed)
    assert torch.equal(rejection_sample(**_on_device(case)).cpu(), rejection_sample_ref(**case))


def test_greedy_accepts_the_agreeing_prefix_then_corrects():
    case = dict(draft_token_ids=torch.tensor([4, 5, 6]), cu_num_drafts=torch.tensor([0, 3]),
                target_argmax=torch.tensor([4, 5, 1]), target_probs=torch.ones(3), draft_probs=torch.ones(3),
                uniform=torch.zeros(3), recovered_token_ids=torch.tensor([4, 5, 1]),
                bonus_token_ids=torch.tensor([9]), is_greedy=torch.tensor([True]), max_drafts=3)
    assert rejection_sample(**_on_device(case)).tolist() == [[4, 5, 1, -1]]
    case["target_argmax"] = torch.tensor([4, 5, 6])
    assert rejection_sample(**_on_device(case)).tolist() == [[4, 5, 6, 9]]  # all accepted: the bonus token follows


def test_the_output_follows_the_target_distribution():
    """Chi-square: one draft token from a point-mass proposer (n-gram), target p over 4 tokens; the first
    output token must be distributed as p whether the draft is right or not."""
    torch.manual_seed(0)
    p = torch.tensor([0.1, 0.2, 0.3, 0.4])
    trials, draft = 20000, 2
    u = torch.rand(trials)
    residual = p.clone()
    residual[draft] = 0  # (p - q)+ for a point mass q on the draft
    recovered = torch.multinomial(residual / residual.sum(), trials, replacement=True)
    out = rejection_sample_ref(torch.full((trials,), draft), torch.arange(trials + 1), torch.zeros(trials),
                               torch.full((trials,), float(p[draft])), torch.ones(trials), u, recovered,
                               torch.zeros(trials, dtype=torch.int64), torch.zeros(trials, dtype=torch.bool), 1)
    counts = torch.bincount(out[:, 0], minlength=4).float()
    chi2 = float(((counts - trials * p) ** 2 / (trials * p)).sum())
    assert chi2 < 16.3  # 3 degrees of freedom, p = 0.001
