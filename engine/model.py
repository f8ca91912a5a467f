"""GPT-2, written for a paged KV cache.

Pre-LN blocks, GELU (tanh approximation), learned positions, LM head tied to the token
embedding. Inputs are the step's flattened tokens (no batch dimension, no padding); each
attention layer writes its new K/V into its cache blocks and reads the whole context back
through the block tables in ``AttentionMetadata``.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionBackend, AttentionMetadata
from engine.model_loader import GPT2Config
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


class Attention(nn.Module):
    def __init__(self, cfg: GPT2Config, layer_idx: int, backend: AttentionBackend):
        super().__init__()
        self.n_head, self.head_size = cfg.n_head, cfg.head_size
        self.c_attn = Conv1D(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = Conv1D(cfg.n_embd, cfg.n_embd)
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
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.c_fc = Conv1D(cfg.n_embd, cfg.n_inner)
        self.c_proj = Conv1D(cfg.n_inner, cfg.n_embd)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: GPT2Config, layer_idx: int, backend: AttentionBackend):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.attn = Attention(cfg, layer_idx, backend)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.mlp = MLP(cfg)

    def forward(self, x, kv_cache, meta):
        x = x + self.attn(self.ln_1(x), kv_cache, meta)
        return x + self.mlp(self.ln_2(x))


class GPT2Model(nn.Module):
    def __init__(self, cfg: GPT2Config, backend: AttentionBackend):
        super().__init__()
        self.cfg = cfg
        self.backend = backend
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.n_positions, cfg.n_embd)
        self.h = nn.ModuleList(Block(cfg, i, backend) for i in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)

    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata) -> torch.Tensor:
        """Returns the final hidden states [num_tokens, n_embd]."""
        self.backend.prepare(meta, kv_caches[0][0].shape[1])  # once per forward: indexing all layers share
        x = self.wte(input_ids) + self.wpe(positions)
        for i, block in enumerate(self.h):
            instrument.set_tags(layer=i)  # labels kernel launches; a no-op unless observed
            x = block(x, kv_caches[i], meta)
        return self.ln_f(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.wte.weight)  # tied LM head

    def load_hf_weights(self, state: dict[str, torch.Tensor]) -> None:
        """Load a Hugging Face GPT-2 state dict by name (same names, same layouts)."""
        own = self.state_dict()
        missing = set(own)
        for name, tensor in state.items():
            if name.endswith((".attn.bias", ".attn.masked_bias")) or name == "lm_head.weight":
                continue  # causal-mask buffers; the LM head is tied to wte
            if name not in own:
                raise ValueError(f"unexpected weight {name!r} in checkpoint")
            if tensor.shape != own[name].shape:
                raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(own[name].shape)}")
            own[name].copy_(tensor)
            missing.discard(name)
        if missing:
            raise ValueError(f"checkpoint is missing weights: {sorted(missing)[:5]}")
