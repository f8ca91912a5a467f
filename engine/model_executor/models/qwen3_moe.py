"""Qwen3-MoE (vLLM's ``models/qwen3_moe.py``): Qwen3's attention, and in place of the dense MLP
a mixture of experts: the router (``gate``) scores the E experts, each token goes through its
top-k (``experts``, a ``FusedMoE``) and their outputs are summed with the routing weights,
renormalised to 1 when the config says ``norm_topk_prob``. Qwen3-30B-A3B: 128 experts of 768
features, 8 per token, so a token uses ~3B of the ~30B parameters.

A layer is sparse when (i + 1) % decoder_sparse_step == 0 and i is not in mlp_only_layers;
the other layers keep a dense SwiGLU MLP of intermediate_size. Weights load from either
layout of the experts (layers/fused_moe/layer.py): one tensor per expert and projection
(``mlp.experts.N.gate_proj.weight``, hub checkpoints) or all experts fused
(``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``: what transformers 5 holds).
"""
from __future__ import annotations

import re

import torch
from torch import nn

from engine.model_executor.layers.fused_moe import FusedMoE, GateLinear
from engine.model_executor.models.qwen3 import Qwen3DecoderLayer, Qwen3ForCausalLM

# (our parameter, shard) of each expert tensor a checkpoint may hold: per expert (HF Qwen3-MoE's
# gate/up/down_proj, Mixtral's w1/w3/w2) or every expert fused (transformers 5)
EXPERT_PARAMS = {"gate_proj": ("w13_weight", "w1"), "up_proj": ("w13_weight", "w3"), "down_proj": ("w2_weight", "w2"),
                 "w1": ("w13_weight", "w1"), "w3": ("w13_weight", "w3"), "w2": ("w2_weight", "w2")}
FUSED_PARAMS = {"gate_up_proj": ("w13_weight", "w13"), "down_proj": ("w2_weight", "w2"),
                "gate_up_proj_bias": ("w13_bias", "w13"), "down_proj_bias": ("w2_bias", "w2")}  # biases: gpt-oss
EXPERT_RE = re.compile(r"^(?P<layer>.+)\.experts\.(?:(?P<id>\d+)\.(?P<proj>\w+)\.weight|(?P<fused>\w+))$")


class Qwen3MoeSparseMoeBlock(nn.Module):
    def __init__(self, cfg, tp, backend, renormalize: bool):
        super().__init__()
        self.gate = GateLinear(cfg.hidden_size, cfg.num_experts, tp)
        self.experts = FusedMoE(cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size,
                                tp, backend, renormalize)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.gate(x))  # router logits [T, E]


def is_sparse(cfg, layer_idx: int) -> bool:
    return (cfg.num_experts > 0 and (layer_idx + 1) % cfg.decoder_sparse_step == 0
            and layer_idx not in cfg.mlp_only_layers)


class Qwen3MoeDecoderLayer(Qwen3DecoderLayer):
    def make_mlp(self, cfg, layer_idx, backend, tp):
        if is_sparse(cfg, layer_idx):
            return Qwen3MoeSparseMoeBlock(cfg, tp, backend, cfg.norm_topk_prob)
        return super().make_mlp(cfg, layer_idx, backend, tp)


def moe_layers(model: nn.Module) -> dict[str, FusedMoE]:
    """Module path -> FusedMoE, of every sparse layer."""
    return {name: m for name, m in model.named_modules() if isinstance(m, FusedMoE)}


def load_moe_weights(model: nn.Module, state: dict[str, torch.Tensor], rename: tuple[str, str] | None,
                     load_rest) -> None:
    """Load the experts' tensors into their FusedMoE, the rest through ``load_rest`` (the
    dense model's loader). ``rename`` (old, new): a module name the checkpoint may spell
    differently (Mixtral's hub ``block_sparse_moe`` is transformers 5's ``mlp``)."""
    layers, params = moe_layers(model), dict(model.named_parameters())
    rest = {}
    for name, w in state.items():
        if rename is not None:
            name = name.replace(*rename)
        m = EXPERT_RE.match(name)
        if m is None or f"{m['layer']}.experts" not in layers:
            rest[name] = w
            continue
        target = FUSED_PARAMS.get(m["fused"]) if m["fused"] else EXPERT_PARAMS.get(m["proj"])
        if target is None:
            raise ValueError(f"unexpected weight {name!r} in checkpoint")
        param_name, shard = target
        param = params[f"{m['layer']}.experts.{param_name}"]
        param.weight_loader(param, w, shard, None if m["fused"] else int(m["id"]))
    load_rest(rest)
    for name, layer in layers.items():
        missing = layer.missing_weights()
        if missing:
            raise ValueError(f"checkpoint is missing weights of {name}: {missing[:5]}")


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    decoder_layer = Qwen3MoeDecoderLayer

    def load_hf_weights(self, state: dict[str, torch.Tensor]) -> None:
        load_moe_weights(self, state, None, super().load_hf_weights)
