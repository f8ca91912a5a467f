"""Qwen3 (vLLM's ``models/qwen3.py``): Llama's layers plus an RMSNorm over each head of q and
of k (``q_norm``, ``k_norm``, one weight of head_dim shared by all heads) before RoPE. Its
head_dim is set in config.json rather than derived (Qwen3-0.6B: 16 heads x 128 on a 1024-wide
residual), and its small models tie the LM head to the embedding."""
from __future__ import annotations

import torch

from engine.model_executor.layers.layernorm import RMSNorm
from engine.model_executor.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM


class Qwen3Attention(LlamaAttention):
    def __init__(self, cfg, layer_idx, backend, tp):
        super().__init__(cfg, layer_idx, backend, tp)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def qk_norm(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q_norm(q), self.k_norm(k)  # per head: q, k are [tokens, heads, head_dim]


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3ForCausalLM(LlamaForCausalLM):
    decoder_layer = Qwen3DecoderLayer
