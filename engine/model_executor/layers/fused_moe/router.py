"""The router: a linear layer gives each token one logit per expert (``GateLinear``, replicated
on every rank: it is E x hidden, small), and ``fused_topk`` keeps each token's top-k experts
(vLLM's ``router/fused_topk_router.py``).

The weights are the softmax over all E experts at the chosen k; whether they are then
renormalised to sum to 1 over the k is the architecture's choice: Mixtral always does
(a softmax over the k chosen logits), Qwen3-MoE when its config says ``norm_topk_prob``
(Qwen3-30B-A3B does; without it a token's expert outputs are summed with weights below 1).
gpt-oss renormalises too: its softmax over the k chosen logits is this, as Mixtral's is.
"""
from __future__ import annotations

import torch

from engine.distributed.parallel_state import TPGroup
from engine.model_executor.layers.linear import LinearBase


class GateLinear(LinearBase):
    """hidden -> one logit per expert, the whole matrix on every rank (vLLM's ReplicatedLinear);
    gpt-oss's router has a bias."""

    def __init__(self, hidden_size: int, num_experts: int, tp: TPGroup, bias: bool = False):
        super().__init__(hidden_size, num_experts, tp, bias=bias)


def fused_topk(gating_output: torch.Tensor, topk: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router logits [T, E] -> (topk_weights [T, topk] float32, topk_ids [T, topk] int64), each
    token's experts best first."""
    probs = torch.softmax(gating_output, dim=-1, dtype=torch.float32)
    topk_weights, topk_ids = probs.topk(topk, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids
