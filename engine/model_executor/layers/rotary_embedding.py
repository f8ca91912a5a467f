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
interpolates between; "yarn" (gpt-oss; vLLM's ``YaRNScalingRotaryEmbedding``) interpolates the
low frequencies (divided by ``factor``), keeps the high ones (those turning more than
``beta_fast`` times over original_max_position_embeddings), ramps linearly between, and scales
cos and sin by the attention factor (0.1·ln(factor) + 1 unless the config gives one), so every
q·k logit by its square. model_loader refuses any other type by name.
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
        self.max_position = max_position
        inv_freq = self._compute_inv_freq()
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [max_position, head_size / 2]
        cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
        if self.scaling.get("rope_type") == "yarn":
            cache = cache * _yarn_mscale(self.scaling, _yarn_factor(self.scaling, max_position)[0])
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def _compute_inv_freq(self) -> torch.Tensor:
        d = self.head_size
        inv_freq = 1.0 / (self.base ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        kind = self.scaling.get("rope_type")
        if kind == "linear":
            return inv_freq / self.scaling["factor"]
        if kind == "llama3":
            return _llama3_inv_freq(inv_freq, **{k: self.scaling[k] for k in (
                "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")})
        if kind == "yarn":
            return _yarn_inv_freq(self.base, d, self.scaling, self.max_position)
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


def _yarn_inv_freq(base: float, d: int, scaling: dict, max_position: int) -> torch.Tensor:
    """YaRN's frequencies, as transformers' ``_compute_yarn_parameters`` computes them."""
    factor, old = _yarn_factor(scaling, max_position)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:  # the dimension turning num_rotations times over `old`
        return d * math.log(old / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # no division by zero
    ramp = ((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, d, 2).float() / d)
    extrapolation = 1 - ramp  # 1: the frequency kept, 0: divided by factor
    return 1.0 / (factor * pos_freqs) * (1 - extrapolation) + 1.0 / pos_freqs * extrapolation


def _yarn_factor(scaling: dict, max_position: int) -> tuple[float, int]:
    """(factor, original_max_position_embeddings): without a factor, max_position over the original."""
    old = scaling.get("original_max_position_embeddings") or max_position
    return scaling.get("factor") or max_position / old, old


def _yarn_mscale(scaling: dict, factor: float) -> float:
    """YaRN's attention factor: the config's, else 0.1·ln(factor) + 1 (with mscale and mscale_all_dim:
    a ratio of two such), as transformers computes it."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
    return get_mscale(factor)


def get_rope(head_size: int, max_position: int, base: float, rope_scaling: dict | None) -> RotaryEmbedding:
    return RotaryEmbedding(head_size, max_position, base, rope_scaling)
