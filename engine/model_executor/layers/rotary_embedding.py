"""Rotary position embedding (vLLM's ``layers/rotary_embedding.py``, RoFormer; the "neox"
layout Llama and Qwen3 use: a head's dims [0, d/2) pair with [d/2, d)).

Each pair (x1, x2) of a query or key head at position p is rotated by the angle p·θ_i, with
θ_i = base^(-2i/d): q·k then depends on the positions only through their difference. The
rotation is applied to q and k *before* the KV-cache write, so the cache holds rotated keys and
a decode step never rotates old keys again (lesson 20 checks this on the cached keys).

cos and sin of every (position, frequency) are computed once, up to max_position, and looked
up by each token's position: the step's ``positions`` tensor, the same the model runner builds
for GPT-2's learned position table.

Scalings (``rope_scaling`` in config.json): "linear" divides every frequency by ``factor``;
"llama3" (Llama 3.1+) divides the low frequencies (wavelengths longer than
original_max_position_embeddings / low_freq_factor) by ``factor``, keeps the high ones, and
interpolates between. model_loader refuses any other type by name.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from kernels import instrument


class RotaryEmbedding(nn.Module):
    def __init__(self, head_size: int, max_position: int, base: float, scaling: dict | None = None):
        super().__init__()
        self.head_size, self.base, self.scaling = head_size, base, scaling or {}
        inv_freq = self._compute_inv_freq()
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [max_position, head_size / 2]
        self.register_buffer("cos_sin_cache", torch.cat([freqs.cos(), freqs.sin()], dim=-1), persistent=False)

    def _compute_inv_freq(self) -> torch.Tensor:
        d = self.head_size
        inv_freq = 1.0 / (self.base ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        kind = self.scaling.get("rope_type")
        if kind == "linear":
            return inv_freq / self.scaling["factor"]
        if kind == "llama3":
            return _llama3_inv_freq(inv_freq, **{k: self.scaling[k] for k in (
                "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")})
        return inv_freq

    def forward(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor):
        """query [T, num_heads, head_size], key [T, num_kv_heads, head_size] -> both rotated.
        Traced as one launch (``rotary_embedding``) with the positions it read."""
        return instrument.call("rotary_embedding", self.forward_native, dict(positions=positions, query=query, key=key),
                               reason="RoPE on q and k, before the KV-cache write")

    def forward_native(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor):
        cos, sin = self.cos_sin_cache[positions].to(query.dtype).unsqueeze(1).chunk(2, dim=-1)  # [T, 1, d/2]
        return _rotate(query, cos, sin), _rotate(key, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _llama3_inv_freq(inv_freq: torch.Tensor, factor: float, low_freq_factor: float, high_freq_factor: float,
                     original_max_position_embeddings: int) -> torch.Tensor:
    old = original_max_position_embeddings
    low_freq_wavelen, high_freq_wavelen = old / low_freq_factor, old / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def get_rope(head_size: int, max_position: int, base: float, rope_scaling: dict | None) -> RotaryEmbedding:
    return RotaryEmbedding(head_size, max_position, base, rope_scaling)
