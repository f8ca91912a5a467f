"""Gemma 3, text only (vLLM's ``models/gemma3.py``): Llama's attention and gated MLP, with

* local and global layers: ``layer_types`` (five ``sliding_attention`` layers to one
  ``full_attention`` in the released models) put each layer's K/V in a sliding-window or a
  full-attention KV-cache group (engine/core/kv_cache_interface.py); the local layers rotate by
  their own RoPE base (10,000), the global ones by the global base (1,000,000) and its scaling;
* RMSNorm that multiplies by (1 + weight), over q and k of each head too, and around both
  sub-layers (``input_layernorm`` and ``post_attention_layernorm`` around attention,
  ``pre_feedforward_layernorm`` and ``post_feedforward_layernorm`` around the MLP);
* attention scaled by ``query_pre_attn_scalar ** -0.5`` rather than head_dim's;
* GeGLU (gelu_pytorch_tanh(gate) · up) and the embedding scaled by sqrt(hidden_size), in the
  weights' dtype; the LM head tied to the embedding.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.distributed.parallel_state import TPGroup
from engine.model_executor.layers.activation import GeluAndMul
from engine.model_executor.layers.attention import AttentionBackend
from engine.model_executor.layers.layernorm import GemmaRMSNorm
from engine.model_executor.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from engine.model_executor.layers.rotary_embedding import get_rope
from engine.model_executor.model_loader import LlamaConfig
from engine.model_executor.models.llama import LlamaAttention, LlamaForCausalLM, LlamaModel
from kernels import instrument


class Gemma3Attention(LlamaAttention):
    def __init__(self, cfg: LlamaConfig, layer_idx: int, backend: AttentionBackend, tp: TPGroup):
        super().__init__(cfg, layer_idx, backend, tp)
        self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.scaling = cfg.query_pre_attn_scalar ** -0.5
        if cfg.layer_sliding_windows[layer_idx]:  # a local layer: its own RoPE base, no scaling
            self.rotary_emb = get_rope(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_local_theta, None)

    def qk_norm(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q_norm(q), self.k_norm(k)


class Gemma3MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig, tp: TPGroup):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, tp, bias=False)
        self.act_fn = GeluAndMul()
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, tp, "mlp.down_proj", bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer_idx: int, backend: AttentionBackend, tp: TPGroup):
        super().__init__()
        self.self_attn = Gemma3Attention(cfg, layer_idx, backend, tp)
        self.mlp = Gemma3MLP(cfg, tp)
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions, x, kv_cache, meta):
        x = x + self.post_attention_layernorm(self.self_attn(positions, self.input_layernorm(x), kv_cache, meta))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3Model(LlamaModel):
    def __init__(self, cfg: LlamaConfig, backend: AttentionBackend, tp: TPGroup, layer_cls: type):
        super().__init__(cfg, backend, tp, layer_cls)
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.normalizer = cfg.hidden_size ** 0.5  # the embedding's scale (rounded to the weights' dtype)

    def forward(self, input_ids, positions, kv_caches, meta):
        x = self.embed_tokens(input_ids)
        x = x * torch.tensor(self.normalizer, dtype=x.dtype)
        for i, layer in enumerate(self.layers):
            instrument.set_tags(layer=i)  # labels kernel launches; a no-op unless observed
            x = layer(positions, x, kv_caches[i], meta.for_layer(i))
        instrument.set_tags(layer=None)
        return self.norm(x)


class Gemma3ForCausalLM(LlamaForCausalLM):
    model_cls = Gemma3Model
    decoder_layer = Gemma3DecoderLayer
