"""gpt-oss (vLLM's ``models/gpt_oss.py``: ``OAIAttention``, ``MLPBlock``): Llama's pre-norm layers with

* attention that alternates a sliding window (128 tokens in the released models) and full
  attention (``layer_types``; each kind is a KV-cache group, engine/core/kv_cache_interface.py),
  biases on q, k, v and o, and **attention sinks**: one learned logit per query head that joins
  the softmax as a column with no value (``sinks``), so a head may attend to nothing; the
  attention kernels take them (kernels/unified_attention.py). Split over TP ranks by head;
* YaRN RoPE (layers/rotary_embedding.py), whose attention factor scales cos and sin;
* a mixture of experts in every layer (``MLPBlock``): a router with a bias, each token's top-k
  experts weighted by a softmax over the k chosen logits, and experts with biases and a clamped
  SwiGLU ``(up + 1) · gate · sigmoid(alpha · gate)``, gate clamped above at limit and up to
  [-limit, limit] (vLLM's ``activation="swigluoai"``; layers/fused_moe/).

transformers holds each layer's experts as ``experts.gate_up_proj`` [E, H, 2·I], gate and up
features interleaved (gate at even columns), with ``gate_up_proj_bias`` [E, 2·I] likewise, and
``experts.down_proj`` [E, I, H]. The loader turns them into FusedMoE's layout (gate rows, then up
rows, [E, 2·I, H]; down [E, H, I]), so the grouped GEMMs are those of every other mixture of
experts. Hub checkpoints of the released models hold MXFP4-quantized experts: refused by
model_loader (dequantized ones load).
"""
from __future__ import annotations

import re

import torch
from torch import nn

from engine.model_executor.layers.fused_moe import FusedMoE, GateLinear
from engine.model_executor.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM
from engine.model_executor.models.qwen3_moe import load_moe_weights

EXPERTS_RE = re.compile(r"^(?P<layer>.+\.experts)\.(?P<name>gate_up_proj|gate_up_proj_bias|down_proj|down_proj_bias)$")


class OAIAttention(LlamaAttention):
    def __init__(self, cfg, layer_idx, backend, tp):
        super().__init__(cfg, layer_idx, backend, tp)  # q/k/v/o biases: cfg.attention_bias
        self.tp = tp
        self.sinks = nn.Parameter(torch.empty(self.num_heads))  # this rank's query heads
        self.sinks.weight_loader = self.load_sinks
        self.sinks.num_shards = 1

    def load_sinks(self, param: nn.Parameter, w: torch.Tensor, shard_id=None) -> None:
        start = self.tp.rank * self.num_heads
        param.data.copy_(w[start:start + self.num_heads])


class MLPBlock(nn.Module):
    def __init__(self, cfg, tp, backend):
        super().__init__()
        self.router = GateLinear(cfg.hidden_size, cfg.num_experts, tp, bias=True)
        self.experts = FusedMoE(cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size,
                                tp, backend, renormalize=True, has_bias=True, activation="swigluoai",
                                swiglu_alpha=cfg.swiglu_alpha, swiglu_limit=cfg.swiglu_limit)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.router(x))


class TransformerBlock(LlamaDecoderLayer):
    attention_cls = OAIAttention

    def make_mlp(self, cfg, layer_idx, backend, tp):
        return MLPBlock(cfg, tp, backend)


def fused_expert_layout(name: str, w: torch.Tensor) -> torch.Tensor:
    """One of transformers' gpt-oss expert tensors in the layout FusedMoE loads (see the module docstring)."""
    if name.startswith("gate_up_proj"):  # de-interleave: gate features first, then up
        w = torch.cat([w[..., ::2], w[..., 1::2]], dim=-1)
    return w.transpose(1, 2) if w.dim() == 3 else w


class GptOssForCausalLM(LlamaForCausalLM):
    decoder_layer = TransformerBlock

    def load_hf_weights(self, state: dict[str, torch.Tensor]) -> None:
        converted = {}
        for name, w in state.items():
            m = EXPERTS_RE.match(name)
            converted[name] = fused_expert_layout(m["name"], w) if m else w
        load_moe_weights(self, converted, None, super().load_hf_weights)
