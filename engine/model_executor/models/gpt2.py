"""GPT-2, written for a paged KV cache.

Pre-LN blocks, GELU (tanh approximation), learned positions, LM head tied to the token
embedding. Inputs are the step's flattened tokens (no batch dimension, no padding); each
attention layer writes its new K/V into its cache blocks and reads the whole context back
through the block tables in ``AttentionMetadata``.

Tensor parallelism (Megatron style, as vLLM's gpt2.py) when built with a ``TPGroup`` of N ranks:

* ``attn.c_attn`` is column-parallel by heads: rank r holds heads [r·H/N, (r+1)·H/N) of each of
  q, k and v (its columns of each third of the fused weight), so attention needs no
  communication and the rank's KV cache holds only its heads.
* ``attn.c_proj`` and ``mlp.c_proj`` are row-parallel: each rank multiplies its slice of the
  input features and the partial sums are all-reduced; the bias is added once (by rank 0,
  before the sum), not N times.
* ``mlp.c_fc`` is column-parallel (its slice of the 4·n_embd features; GELU is elementwise).
* ``wte`` is vocab-parallel (``VocabParallelEmbedding``): rank r holds rows [r·V'/N, (r+1)·V'/N)
  of the vocabulary padded to V', a multiple of 64; a lookup finds the ids in its shard and one
  all-reduce per step sums the ranks' vectors. The tied LM head is that same shard: each rank
  computes its slice of the logits, they are all-gathered (vLLM V1's ``LogitsProcessor``
  all-gathers) and the padding's columns cut off, so every rank holds the whole logits and
  runs the sampler; the executor keeps rank 0's output.
* ``wpe`` and the layer norms are replicated.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from engine.distributed.parallel_state import TPGroup
from engine.model_executor.layers.activation import NewGELU
from engine.model_executor.layers.attention import AttentionBackend, AttentionMetadata
from engine.model_executor.layers.logits_processor import LogitsProcessor
from engine.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
from engine.model_executor.model_loader import GPT2Config
from kernels import instrument


class Conv1D(nn.Module):
    """A linear layer with its weight stored [in, out], as GPT-2 checkpoints store it: loads
    without a transpose, and addmm on this layout is faster on the CPU than nn.Linear's
    [out, in] (measured ~25 % at decode batch sizes)."""

    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_in, n_out))
        self.bias = nn.Parameter(torch.zeros(n_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias, x, self.weight)


class RowParallelConv1D(Conv1D):
    """Conv1D over this rank's slice of the input features: partial sums, all-reduced. The
    bias is added by rank 0 only, before the sum, so it counts once."""

    def __init__(self, n_in: int, n_out: int, tp: TPGroup, site: str):
        super().__init__(n_in // tp.world_size, n_out)
        self.tp, self.site = tp, site

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return torch.addmm(self.bias, x, self.weight)
        y = torch.addmm(self.bias, x, self.weight) if self.tp.is_driver else x @ self.weight
        return self.tp.all_reduce(y, self.site)


class Attention(nn.Module):
    def __init__(self, cfg: GPT2Config, layer_idx: int, backend: AttentionBackend, tp: TPGroup):
        super().__init__()
        self.n_head, self.head_size = cfg.n_head // tp.world_size, cfg.head_size  # this rank's heads
        self.c_attn = Conv1D(cfg.n_embd, 3 * cfg.n_embd // tp.world_size)
        self.c_proj = RowParallelConv1D(cfg.n_embd, cfg.n_embd, tp, "attn.c_proj")
        self.scale = 1.0 / math.sqrt(self.head_size)
        if cfg.scale_attn_by_inverse_layer_idx:
            self.scale /= layer_idx + 1
        self.backend = backend
        self.layer_idx = layer_idx

    def forward(self, x: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata):
        T = x.shape[0]
        q, k, v = self.c_attn(x).view(T, 3, self.n_head, self.head_size).unbind(1)
        o = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        return self.c_proj(o.reshape(T, -1))


class MLP(nn.Module):
    def __init__(self, cfg: GPT2Config, tp: TPGroup):
        super().__init__()
        self.c_fc = Conv1D(cfg.n_embd, cfg.n_inner // tp.world_size)
        self.act = NewGELU()
        self.c_proj = RowParallelConv1D(cfg.n_inner, cfg.n_embd, tp, "mlp.c_proj")

    def forward(self, x):
        return self.c_proj(self.act(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPT2Config, layer_idx: int, backend: AttentionBackend, tp: TPGroup):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.attn = Attention(cfg, layer_idx, backend, tp)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.mlp = MLP(cfg, tp)

    def forward(self, x, kv_cache, meta):
        x = x + self.attn(self.ln_1(x), kv_cache, meta)
        return x + self.mlp(self.ln_2(x))


def check_tp_size(cfg: GPT2Config, tp_size: int) -> None:
    """Raise ValueError unless the model can be split over tp_size ranks."""
    if cfg.n_head % tp_size:
        divisors = [d for d in range(1, cfg.n_head + 1) if cfg.n_head % d == 0]
        raise ValueError(f"tensor_parallel_size={tp_size} must divide the model's {cfg.n_head} attention heads "
                         f"(each rank holds whole heads); choose one of {divisors}")
    if cfg.n_inner % tp_size:
        raise ValueError(f"tensor_parallel_size={tp_size} must divide the MLP's {cfg.n_inner} features")


class GPT2Model(nn.Module):
    def __init__(self, cfg: GPT2Config, backend: AttentionBackend, tp: TPGroup | None = None):
        super().__init__()
        self.cfg = cfg
        self.backend = backend
        self.tp = tp = tp or TPGroup()
        check_tp_size(cfg, tp.world_size)
        self.wte = VocabParallelEmbedding(cfg.vocab_size, cfg.n_embd, tp)
        self.wpe = nn.Embedding(cfg.n_positions, cfg.n_embd)
        self.h = nn.ModuleList(Block(cfg, i, backend, tp) for i in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.logits_processor = LogitsProcessor(cfg.vocab_size, tp)

    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata) -> torch.Tensor:
        """Returns the final hidden states [num_tokens, n_embd]."""
        self.backend.prepare(meta, kv_caches[0][0].shape[1])  # once per forward: indexing all layers share
        instrument.set_tags(layer=None)  # the embedding's all-reduce belongs to no layer
        x = self.wte(input_ids) + self.wpe(positions)
        for i, block in enumerate(self.h):
            instrument.set_tags(layer=i)  # labels kernel launches; a no-op unless observed
            x = block(x, kv_caches[i], meta)
        instrument.set_tags(layer=None)  # nor does the LM head's all-gather
        return self.ln_f(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [rows, vocab_size], on every rank."""
        return self.logits_processor(hidden, self.wte.weight)  # tied LM head: this rank's slice of the vocabulary

    def load_hf_weights(self, state: dict[str, torch.Tensor]) -> None:
        """Load a Hugging Face GPT-2 state dict by name (same names, same layouts), each weight
        cut to this rank's shard (see the module docstring)."""
        own = self.state_dict()
        missing = set(own)
        for name, tensor in state.items():
            if name.endswith((".attn.bias", ".attn.masked_bias")) or name == "lm_head.weight":
                continue  # causal-mask buffers; the LM head is tied to wte
            if name not in own:
                raise ValueError(f"unexpected weight {name!r} in checkpoint")
            tensor = self._shard(name, tensor)
            if tensor.shape != own[name].shape:
                raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(own[name].shape)}")
            own[name].copy_(tensor)
            missing.discard(name)
        if missing:
            raise ValueError(f"checkpoint is missing weights: {sorted(missing)[:5]}")

    def _shard(self, name: str, w: torch.Tensor) -> torch.Tensor:
        """This rank's part of a full checkpoint weight (Conv1D weights are [in, out])."""
        tp = self.tp
        if tp.world_size == 1:
            return w
        if name.endswith("attn.c_attn.weight") or name.endswith("attn.c_attn.bias"):
            a, b = tp.shard(self.cfg.n_embd)  # this rank's heads, from each of q, k and v
            return torch.cat([third[..., a:b] for third in w.chunk(3, dim=-1)], dim=-1)
        if name.endswith("mlp.c_fc.weight") or name.endswith("mlp.c_fc.bias"):
            a, b = tp.shard(w.shape[-1])  # column-parallel: output features
            return w[..., a:b]
        if name.endswith(("attn.c_proj.weight", "mlp.c_proj.weight")):
            a, b = tp.shard(w.shape[0])  # row-parallel: input features (the bias stays whole)
            return w[a:b]
        if name == "wte.weight":
            return self.wte.shard(w)  # vocab-parallel: this rank's rows, zero-padded
        return w  # wpe, layer norms, row-parallel biases: replicated
