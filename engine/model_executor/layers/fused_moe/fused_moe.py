"""The experts' computation, chosen like attention (layers/attention.py): the Triton kernel
(kernels/fused_moe.py) with the triton backend, its PyTorch reference (kernels/reference.py,
the same expert blocks through batched matmuls) with the torch backend, the CPU's default."""
from __future__ import annotations

import torch

import kernels


def fused_experts(hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, backend: str, expert_map: torch.Tensor | None = None,
                  **options) -> torch.Tensor:
    """[T, H] -> [T, H]: each token through its top-k experts, weighted and summed (under expert
    parallelism, expert_map: through this rank's experts only). ``options``: the experts' biases
    and activation when they are not plain SwiGLU (w13_bias, w2_bias, activation, swiglu_alpha,
    swiglu_limit: gpt-oss)."""
    if backend == "triton":
        return kernels.fused_moe(hidden_states, w13, w2, topk_weights, topk_ids, expert_map, **options)
    meta = dict(top_k=topk_ids.shape[1], experts_used=_experts_used(topk_ids, expert_map)) \
        if kernels.instrument.observed() else None  # the weights it reads (the profile's bytes)
    return kernels.instrument.call("fused_moe_ref", kernels.fused_moe_ref, dict(
        hidden_states=hidden_states, w13=w13, w2=w2, topk_weights=topk_weights, topk_ids=topk_ids,
        expert_map=expert_map, **options), reason="attention_backend=torch: PyTorch reference", meta=meta)


def _experts_used(topk_ids: torch.Tensor, expert_map: torch.Tensor | None) -> int:
    """How many of this rank's experts some token chose."""
    used = topk_ids.unique()
    return int(used.numel() if expert_map is None else (expert_map[used] >= 0).sum())
