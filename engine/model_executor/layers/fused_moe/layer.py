"""``FusedMoE``: every expert's SwiGLU weights of one layer, stacked (vLLM's ``layers/fused_moe/layer.py``).

``w13_weight`` [E, 2·I, H] holds each expert's gate rows then its up rows (HF's w1 / gate_proj
and w3 / up_proj), ``w2_weight`` [E, H, I] its down projection. The forward takes the router's
logits, picks each token's top-k experts (router.py) and runs the experts (fused_moe.py).

Tensor parallelism as for a dense MLP: every rank holds every expert, but only its slice of
each expert's I intermediate features (w13 column-parallel, w2 row-parallel), so each rank's
output is a partial sum, all-reduced. With ``enable_expert_parallel`` rank r instead holds
E/N whole experts, [r·E/N, (r+1)·E/N) (``expert_map``: global id -> its index here, -1 for
another rank's), and the tokens travel by the all2all backend (engine/distributed/all2all.py).
``weight_loader`` takes either one expert's tensor
(``expert_id``: hub checkpoints store experts.N.w1 / gate_proj ...) or all experts' at once
(``expert_id=None``: transformers 5 stores ``experts.gate_up_proj`` [E, 2·I, H] and
``experts.down_proj`` [E, H, I]), and cuts this rank's slice.

gpt-oss's experts (``has_bias``, ``activation="swigluoai"``, as vLLM's FusedMoE takes them) also
hold ``w13_bias`` [E, 2·I] (cut like w13's rows) and ``w2_bias`` [E, H], which, like a
row-parallel layer's bias, is added once: by rank 0 under TP, by the expert's rank under EP.
"""
from __future__ import annotations

import re

import torch
from torch import nn

from engine.distributed.all2all import AgRsAll2AllManager
from engine.distributed.parallel_state import TPGroup
from engine.model_executor.layers.fused_moe.fused_moe import fused_experts
from engine.model_executor.layers.fused_moe.router import fused_topk

SHARDS = ("w1", "w3", "w2")  # gate, up, down


class FusedMoE(nn.Module):
    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, tp: TPGroup,
                 backend, renormalize: bool, site: str = "mlp.experts", has_bias: bool = False,
                 activation: str = "silu", swiglu_alpha: float = 1.702, swiglu_limit: float = 7.0):
        super().__init__()
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.has_bias, self.activation = has_bias, activation
        self.tp, self.backend, self.site = tp, backend, site
        n = tp.world_size
        self.ep_size = n if tp.enable_expert_parallel else 1
        if num_experts % self.ep_size:
            raise ValueError(f"expert parallelism over {n} ranks must divide the model's {num_experts} experts; "
                             "choose a tensor_parallel_size that does")
        self.local_num_experts = e = num_experts // self.ep_size
        self.expert_start = tp.rank * e if self.ep_size > 1 else 0
        self.intermediate_size_per_partition = i = intermediate_size // (n // self.ep_size)
        self.w13_weight = nn.Parameter(torch.empty(e, 2 * i, hidden_size))
        self.w2_weight = nn.Parameter(torch.empty(e, hidden_size, i))
        params = [self.w13_weight, self.w2_weight]
        if has_bias:
            self.w13_bias = nn.Parameter(torch.zeros(e, 2 * i))
            self.w2_bias = nn.Parameter(torch.zeros(e, hidden_size))
            params += [self.w13_bias, self.w2_bias]
        # what the experts' computation takes besides the weights (fused_experts' options)
        self.act_options = {} if activation == "silu" else dict(activation=activation, swiglu_alpha=swiglu_alpha,
                                                                 swiglu_limit=swiglu_limit)
        ids = torch.arange(num_experts) - self.expert_start
        expert_map = torch.where((ids >= 0) & (ids < e), ids, -1) if self.ep_size > 1 else None
        self.register_buffer("expert_map", expert_map, persistent=False)  # moves with the model's device
        self.all2all = AgRsAll2AllManager(tp, site) if self.ep_size > 1 else None
        for p in params:
            p.weight_loader = self.weight_loader
            p.num_shards = 0  # counted here (missing_weights), not by the model's loader
        self._loaded: set[tuple[str, int]] = set()
        # the last forward pass's routing (references, no copy), for the model runner's trace
        self.last_topk_ids: torch.Tensor | None = None
        self.last_topk_weights: torch.Tensor | None = None

    def weight_loader(self, param: nn.Parameter, w: torch.Tensor, shard_id: str, expert_id: int | None = None) -> None:
        """shard_id "w1" (gate), "w3" (up), "w2" (down) or "w13" (gate then up, fused); expert_id
        None: w holds every expert (a leading E dimension). param: a weight or its bias (w13_bias,
        w2_bias: one dimension fewer, the features last)."""
        experts = range(self.num_experts) if expert_id is None else [expert_id]
        if w.dim() != param.dim() - (expert_id is not None) or expert_id is None and w.shape[0] != self.num_experts:
            raise ValueError(f"expert weight of shape {tuple(w.shape)} does not fit {self.num_experts} experts")
        bias = param.dim() == 2
        features = -1 if bias else -2  # the dimension of w13's gate and up features
        if shard_id == "w13":
            gate, up = w.chunk(2, dim=features)
            self.weight_loader(param, gate, "w1", expert_id)
            self.weight_loader(param, up, "w3", expert_id)
            return
        self._loaded.update((shard_id + "_bias" * bias, e) for e in experts)
        first, local = self.expert_start, self.local_num_experts
        if expert_id is None:
            dst, w = param.data, w[first:first + local]  # this rank's experts (all of them without EP)
        elif first <= expert_id < first + local:
            dst = param.data[expert_id - first]
        else:
            return  # another rank's expert
        if shard_id == "w2":
            a, b = (0, w.shape[-1]) if bias else self._shard(w.shape[-1])  # the bias: over H, whole
            dst.copy_(w[..., a:b])
        else:
            a, b = self._shard(w.shape[features])
            offset = 0 if shard_id == "w1" else b - a
            dst.narrow(features, offset, b - a).copy_(w.narrow(features, a, b - a))

    def _shard(self, n: int) -> tuple[int, int]:
        """This rank's slice of an expert's n intermediate features: all of them under EP."""
        return (0, n) if self.ep_size > 1 else self.tp.shard(n)

    def missing_weights(self) -> list[str]:
        shards = SHARDS + tuple(s + "_bias" for s in SHARDS) * self.has_bias
        return [f"expert {e} {s}" for e in range(self.num_experts) for s in shards if (s, e) not in self._loaded]

    def expert_options(self) -> dict:
        """The experts' computation's options: the activation, and the biases (w2's on one rank only)."""
        if not self.has_bias:
            return self.act_options
        options = dict(self.act_options, w13_bias=self.w13_bias)
        if self.ep_size > 1 or self.tp.is_driver:
            options["w2_bias"] = self.w2_bias
        return options

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        if self.ep_size > 1:
            return self.forward_expert_parallel(hidden_states, router_logits)
        topk_weights, topk_ids = fused_topk(router_logits, self.top_k, self.renormalize)
        self.last_topk_ids, self.last_topk_weights = topk_ids, topk_weights
        out = fused_experts(hidden_states, self.w13_weight, self.w2_weight, topk_weights, topk_ids, self.backend.name,
                            **self.expert_options())
        return self.tp.all_reduce(out, self.site)  # each rank's slice of every expert: a partial sum

    def forward_expert_parallel(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """Every token through this rank's experts only; the ranks' outputs summed by the combine."""
        num_tokens = hidden_states.shape[0]
        x = self.all2all.dispatch(hidden_states)
        logits = router_logits.new_zeros(x.shape[0], router_logits.shape[1])  # the padding rows: any expert
        logits[:num_tokens] = router_logits  # (the router is replicated: every rank scores every token)
        topk_weights, topk_ids = fused_topk(logits, self.top_k, self.renormalize)
        self.last_topk_ids, self.last_topk_weights = topk_ids[:num_tokens], topk_weights[:num_tokens]
        out = fused_experts(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids, self.backend.name,
                            self.expert_map, **self.expert_options())
        return self.all2all.combine(out, num_tokens)


def moe_layers(model: nn.Module) -> list[tuple[int, FusedMoE]]:
    """(decoder layer index, its FusedMoE) of every sparse layer of a model, in layer order."""
    return [(int(re.search(r"layers\.(\d+)\.", name)[1]), m) for name, m in model.named_modules()
            if isinstance(m, FusedMoE)]
