"""The grammar-bitmask kernel equals its PyTorch reference, and both equal xgrammar's own."""
import pytest
import torch

import kernels

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # compiled there, interpreted here


@pytest.mark.parametrize("vocab", [100, 4096, 50257])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_matches_reference(vocab, dtype):
    g = torch.Generator().manual_seed(vocab)
    words = -(-vocab // 32)
    logits = torch.randn(5, vocab, generator=g).to(dtype)
    bitmask = torch.randint(-2 ** 31, 2 ** 31 - 1, (3, words), dtype=torch.int32, generator=g)
    bitmask[1] = 0
    bitmask[1, 0] = 1 << 7  # one token allowed: 7
    indices = torch.tensor([4, 0, 2], dtype=torch.int32)
    ref, got = logits.clone(), logits.clone().to(DEVICE)
    kernels.apply_token_bitmask_ref(ref, bitmask, indices)
    kernels.apply_token_bitmask(got, bitmask.to(DEVICE), indices.to(DEVICE))
    assert torch.equal(ref, got.cpu())
    assert torch.equal(ref[[1, 3]], logits[[1, 3]])  # rows without a mask row are untouched
    assert torch.isfinite(ref[0]).nonzero().flatten().tolist() == [7]


def test_reference_matches_xgrammar():
    xgr = pytest.importorskip("xgrammar")
    vocab = 4096
    logits = torch.randn(3, vocab)
    bitmask = torch.randint(-2 ** 31, 2 ** 31 - 1, (3, vocab // 32), dtype=torch.int32)
    ref, theirs = logits.clone(), logits.clone()
    kernels.apply_token_bitmask_ref(ref, bitmask, torch.arange(3))
    xgr.apply_token_bitmask_inplace(theirs, bitmask)
    assert torch.equal(ref, theirs)


def test_launch_is_instrumented():
    seen = []
    logits, bitmask = torch.zeros(1, 64, device=DEVICE), torch.full((1, 2), -1, dtype=torch.int32, device=DEVICE)
    with kernels.instrument.observe(seen.append, access_maps=False):
        kernels.apply_token_bitmask(logits, bitmask, torch.zeros(1, dtype=torch.int32, device=DEVICE))
    assert [r.name for r in seen] == ["apply_token_bitmask"] and seen[0].grid[0] == 1
