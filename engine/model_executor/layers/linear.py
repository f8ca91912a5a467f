"""Tensor-parallel linear layers (vLLM's ``layers/linear.py``, nano-vllm's ``linear.py``).

Weights are stored [out, in], as Hugging Face Llama-family checkpoints store them. Each layer
builds only this rank's shard and gives its parameters a ``weight_loader`` that cuts a full
checkpoint tensor down to that shard, so a model's ``load_weights`` never needs to know how a
layer is split:

* ``ColumnParallelLinear``: rank r holds rows [r·out/N, (r+1)·out/N) of the output features.
* ``MergedColumnParallelLinear``: several column-parallel outputs fused in one matmul (the MLP's
  gate and up projections); each rank holds its slice of each.
* ``QKVParallelLinear``: q, k and v in one matmul; each rank holds whole heads: num_heads / N
  query heads and num_kv_heads / N KV heads (so the KV cache of a rank holds only its KV heads).
* ``RowParallelLinear``: input features split; the partial sums are all-reduced, and the bias
  is added once (by rank 0, before the sum), not N times.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed.parallel_state import TPGroup


class LinearBase(nn.Module):
    def __init__(self, n_in: int, n_out: int, tp: TPGroup, bias: bool):
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(n_out, n_in))
        self.weight.weight_loader = self.weight_loader
        self.weight.num_shards = 1
        if bias:
            self.bias = nn.Parameter(torch.zeros(n_out))
            self.bias.weight_loader = self.weight_loader
            self.bias.num_shards = 1
        else:
            self.bias = None

    def weight_loader(self, param: nn.Parameter, w: torch.Tensor, shard_id=None) -> None:
        param.data.copy_(w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class ColumnParallelLinear(LinearBase):
    def __init__(self, n_in: int, n_out: int, tp: TPGroup, bias: bool = False):
        super().__init__(n_in, n_out // tp.world_size, tp, bias)

    def weight_loader(self, param, w, shard_id=None):
        a, b = self.tp.shard(w.shape[0])
        param.data.copy_(w[a:b])


class MergedColumnParallelLinear(ColumnParallelLinear):
    def __init__(self, n_in: int, output_sizes: list[int], tp: TPGroup, bias: bool = False):
        self.output_sizes = output_sizes
        super().__init__(n_in, sum(output_sizes), tp, bias)
        for p in self.parameters():
            p.num_shards = len(output_sizes)

    def weight_loader(self, param, w, shard_id: int):
        n = self.tp.world_size
        offset = sum(self.output_sizes[:shard_id]) // n
        a, b = self.tp.shard(self.output_sizes[shard_id])
        param.data[offset:offset + b - a].copy_(w[a:b])


class QKVParallelLinear(ColumnParallelLinear):
    def __init__(self, hidden_size: int, head_size: int, num_heads: int, num_kv_heads: int, tp: TPGroup,
                 bias: bool = False):
        n = tp.world_size
        self.head_size, self.num_heads, self.num_kv_heads = head_size, num_heads // n, num_kv_heads // n
        super().__init__(hidden_size, (num_heads + 2 * num_kv_heads) * head_size, tp, bias)
        for p in self.parameters():
            p.num_shards = 3

    def weight_loader(self, param, w, shard_id: str):
        q, kv = self.num_heads * self.head_size, self.num_kv_heads * self.head_size
        offset, size = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[shard_id]
        start = self.tp.rank * size  # this rank's whole heads of this projection
        param.data[offset:offset + size].copy_(w[start:start + size])


class RowParallelLinear(LinearBase):
    def __init__(self, n_in: int, n_out: int, tp: TPGroup, site: str, bias: bool = False):
        super().__init__(n_in // tp.world_size, n_out, tp, bias)
        self.site = site  # names the all-reduce in the trace

    def weight_loader(self, param, w, shard_id=None):
        if w.dim() == 1:  # the bias stays whole (added once, by rank 0)
            param.data.copy_(w)
            return
        a, b = self.tp.shard(w.shape[1])
        param.data.copy_(w[:, a:b])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return F.linear(x, self.weight, self.bias)
        y = F.linear(x, self.weight, self.bias if self.tp.is_driver else None)
        return self.tp.all_reduce(y, self.site)
