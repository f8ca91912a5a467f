"""The fused MoE: moe_align_block_size on vLLM's example and on random routings, and the Triton
grouped GEMM against the PyTorch reference against a naive per-expert loop (transformers'
way), at small sizes (interpreted), with its launches recorded with their expert blocks."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_batches import DEVICE

from kernels import fused_moe, fused_moe_ref, instrument, moe_align_block_size


def naive_moe(x, w13, w2, topk_weights, topk_ids):
    """Per expert: the tokens that chose it, through it, added back with their weights."""
    out = torch.zeros_like(x)
    for e in range(w13.shape[0]):
        tok, k = torch.where(topk_ids == e)
        if tok.numel():
            gate, up = (x[tok] @ w13[e].T).chunk(2, dim=-1)
            out.index_add_(0, tok, (F.silu(gate) * up) @ w2[e].T * topk_weights[tok, k, None])
    return out


def routing(T, E, top_k, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=g)
    w, ids = torch.softmax(logits, -1).topk(top_k, dim=-1)
    return w.to(DEVICE), ids.to(DEVICE)


def test_align_matches_vllm_example():
    topk_ids = torch.tensor([[2, 3, 0], [1, 2, 0], [1, 3, 0], [1, 2, 3]])
    sorted_ids, expert_ids, post = moe_align_block_size(topk_ids, 4, 4)
    assert int(post[0]) == 16
    assert sorted_ids[:16].tolist() == [2, 5, 8, 12, 3, 6, 9, 12, 0, 4, 10, 12, 1, 7, 11, 12]
    assert expert_ids[:4].tolist() == [0, 1, 2, 3]
    assert sorted_ids.numel() == 12 + 4 * 3 and (sorted_ids[16:] == 12).all()


@pytest.mark.parametrize("seed", range(4))
def test_align_blocks_are_expert_contiguous(seed):
    T, E, top_k, bm = 13, 8, 2, 4
    _, ids = routing(T, E, top_k, seed)
    sorted_ids, expert_ids, post = moe_align_block_size(ids, bm, E)
    flat, total = ids.flatten(), int(post[0])
    counts = torch.bincount(flat, minlength=E)
    assert total == int(((counts + bm - 1) // bm * bm).sum())
    rows = sorted_ids[:total].view(-1, bm)
    for block, e in zip(rows.tolist(), expert_ids[:total // bm].tolist()):
        real = [r for r in block if r < flat.numel()]
        assert real and all(flat[r] == e for r in real)  # every block has a pair, all of one expert
        assert real == sorted(real) and block[:len(real)] == real  # padding last
    assert sorted(r for r in sorted_ids[:total].tolist() if r < flat.numel()) == list(range(flat.numel()))


@pytest.mark.parametrize("T,E,top_k,H,inter", [(1, 4, 2, 32, 16), (7, 8, 2, 64, 24), (20, 4, 3, 48, 32)])
def test_kernel_equals_reference_equals_naive(T, E, top_k, H, inter):
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, H, generator=g).to(DEVICE)
    w13 = (torch.randn(E, 2 * inter, H, generator=g) / H ** 0.5).to(DEVICE)
    w2 = (torch.randn(E, H, inter, generator=g) / inter ** 0.5).to(DEVICE)
    w, ids = routing(T, E, top_k, T)
    naive = naive_moe(x, w13, w2, w, ids)
    ref = fused_moe_ref(x, w13, w2, w, ids)
    torch.testing.assert_close(ref, naive, rtol=1e-5, atol=1e-5)
    records = []
    with instrument.observe(records.append):
        out = fused_moe(x, w13, w2, w, ids)
    torch.testing.assert_close(out, naive, rtol=1e-4, atol=1e-4)
    assert [r.name for r in records] == ["fused_moe_w13", "fused_moe_w2"]
    used = sorted(set(ids.flatten().tolist()))
    for r in records:
        experts = sorted({a.blocks[0] for accs in r.access_map.values() for a in accs})
        assert experts == used  # one block per used expert at least, none for an idle one
        assert r.grid[0] == (T * top_k + E * 15 + 15) // 16 and r.meta["BLOCK_SIZE_M"] == 16


def test_empty_batch():
    x = torch.zeros(0, 32, device=DEVICE)
    w, ids = torch.zeros(0, 2, device=DEVICE), torch.zeros(0, 2, dtype=torch.long, device=DEVICE)
    w13, w2 = torch.zeros(4, 32, 32, device=DEVICE), torch.zeros(4, 32, 16, device=DEVICE)
    assert fused_moe(x, w13, w2, w, ids).shape == (0, 32)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_expert_parallel_ranks_add_up(backend):
    """Two ranks holding experts [0, 4) and [4, 8): their outputs sum to the whole layer's."""
    T, E, top_k, H, inter = 6, 8, 2, 32, 16
    g = torch.Generator().manual_seed(3)
    x = torch.randn(T, H, generator=g).to(DEVICE)
    w13, w2 = torch.randn(E, 2 * inter, H, generator=g).to(DEVICE), torch.randn(E, H, inter, generator=g).to(DEVICE)
    w, ids = routing(T, E, top_k, 3)
    fn = fused_moe_ref if backend == "reference" else fused_moe
    parts = []
    for rank in range(2):
        mine = torch.arange(E, device=DEVICE) // 4 == rank
        expert_map = torch.where(mine, torch.arange(E, device=DEVICE) % 4, -1)
        parts.append(fn(x, w13[mine], w2[mine], w, ids, expert_map))
        theirs = ~mine[ids].any(dim=1)  # tokens with no expert on this rank get nothing from it
        assert (parts[-1][theirs] == 0).all()
    torch.testing.assert_close(parts[0] + parts[1], naive_moe(x, w13, w2, w, ids), rtol=1e-4, atol=1e-4)


def _gpt_oss_experts(E, H, inter, limit, seed):
    """transformers' GptOssExperts with random weights and biases (its gate_up_proj [E, H, 2I], gate and
    up interleaved), and the same weights in our layout (w13 [E, 2I, H], gate rows then up rows)."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    g = torch.Generator().manual_seed(seed)
    experts = GptOssExperts(GptOssConfig(num_local_experts=E, hidden_size=H, intermediate_size=inter,
                                         swiglu_limit=limit))
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    experts = experts.to(DEVICE)
    gu, gub = experts.gate_up_proj.detach(), experts.gate_up_proj_bias.detach()
    w13 = torch.cat([gu[..., ::2], gu[..., 1::2]], dim=-1).transpose(1, 2).contiguous()
    w13_bias = torch.cat([gub[:, ::2], gub[:, 1::2]], dim=-1).contiguous()
    w2, w2_bias = experts.down_proj.detach().transpose(1, 2).contiguous(), experts.down_proj_bias.detach()
    return experts, dict(w13=w13, w2=w2), dict(w13_bias=w13_bias, w2_bias=w2_bias.contiguous(),
                                               activation="swigluoai", swiglu_alpha=1.702, swiglu_limit=limit)


@pytest.mark.parametrize("fn", [fused_moe_ref, fused_moe], ids=["reference", "triton"])
def test_gpt_oss_experts_equal_transformers(fn):
    """Biases on both GEMMs and the clamped SwiGLU (a limit the random weights pass, so it clamps)."""
    T, E, top_k, H, inter = 7, 4, 2, 32, 16
    experts, weights, options = _gpt_oss_experts(E, H, inter, limit=2.0, seed=5)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    w, ids = routing(T, E, top_k, 7)
    with torch.no_grad():
        want = experts(x, ids, w)
        assert (x @ experts.gate_up_proj[0] + experts.gate_up_proj_bias[0]).abs().max() > 2.0  # it clamps
    got = fn(x, weights["w13"], weights["w2"], w, ids, **options)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    plain = fn(x, weights["w13"], weights["w2"], w, ids)
    assert not torch.allclose(plain, want, atol=1e-2)


def test_gpt_oss_experts_rerun_on_triton_with_their_options():
    """A held reference call's biases and activation go along to the Triton rerun (the TUI's `t`)."""
    from kernels.rerun import moe_inputs, moe_on_triton

    _, weights, options = _gpt_oss_experts(4, 32, 16, limit=2.0, seed=8)
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    w, ids = routing(5, 4, 2, 9)
    got = moe_on_triton(**moe_inputs(dict(hidden_states=x, **weights, topk_weights=w, topk_ids=ids,
                                          expert_map=None, **options)))
    assert got["max_abs_diff"] < 1e-4 and got["meta"]["ACTIVATION"] == "swigluoai" and got["meta"]["HAS_BIAS"]
