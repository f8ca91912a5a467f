"""Mixtral (vLLM's ``models/mixtral.py``): Llama's attention (no q/k norm) and in every layer a
mixture of experts in place of the MLP: E experts (Mixtral-8x7B: 8 of 14336 features), top-2
per token, the two routing weights always renormalised to sum to 1 (a softmax over the two
chosen logits). Hub checkpoints name the block ``block_sparse_moe`` and its experts
``experts.N.w1`` (gate), ``w3`` (up), ``w2`` (down); transformers 5 names it ``mlp`` with
fused experts (``experts.gate_up_proj``, ``experts.down_proj``). Both load (qwen3_moe.py)."""
from __future__ import annotations

import torch

from engine.model_executor.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from engine.model_executor.models.qwen3_moe import Qwen3MoeSparseMoeBlock, load_moe_weights


class MixtralMoE(Qwen3MoeSparseMoeBlock):
    """Qwen3-MoE's router and experts, the top-k weights always renormalised."""

    def __init__(self, cfg, tp, backend):
        super().__init__(cfg, tp, backend, renormalize=True)


class MixtralDecoderLayer(LlamaDecoderLayer):
    def make_mlp(self, cfg, layer_idx, backend, tp):
        return MixtralMoE(cfg, tp, backend)


class MixtralForCausalLM(LlamaForCausalLM):
    decoder_layer = MixtralDecoderLayer

    def load_hf_weights(self, state: dict[str, torch.Tensor]) -> None:
        load_moe_weights(self, state, (".block_sparse_moe.", ".mlp."), super().load_hf_weights)
