"""Mixture-of-experts MLP: each token through its top-k experts, as one grouped GEMM (Triton).

vLLM's ``layers/fused_moe/fused_moe.py`` cut to what an unquantised SwiGLU expert needs:

1. ``moe_align_block_size``: the (token, k) pairs, T·top_k of them, sorted by expert and each
   expert's run padded to a multiple of BLOCK_SIZE_M, so that every block of BLOCK_SIZE_M rows
   belongs to one expert. ``expert_ids`` says which, per block; padding rows hold T·top_k (an
   id past the last pair) and are masked off. At most T·top_k + E·(BLOCK_SIZE_M − 1) rows.
2. ``_fused_moe_kernel`` twice: program (m, n) loads its block's tokens (a gather: row
   ``id // top_k`` of the hidden states), its expert's weight tile, and multiplies. First
   with w13 [E, 2I, H], computing the gate and the up column of the same feature in one
   program and storing silu(gate)·up (SwiGLU fused into the GEMM's epilogue); then with
   w2 [E, H, I], scaling each row by its routing weight. The top_k rows of a token are then
   summed (vLLM's ``moe_sum``).

gpt-oss's experts (vLLM's ``activation="swigluoai"``, ``has_bias``) add a bias to each GEMM's
output (w13_bias [E, 2I] before the activation, w2_bias [E, H] before the routing weight) and
clamp their SwiGLU: gate clamped above at ``limit``, up to [-limit, limit], then
(up + 1) · gate · sigmoid(alpha · gate).

Decode at batch T reads the weights of every expert some token picked (up to min(E, T·top_k)
experts) for T·top_k rows of work: few FLOPs per byte, which is why MoE decode is memory-bound
(kernels/roofline.py). On the interpreter each program costs Python per Triton op, so a
program takes every column at once (BLOCK_SIZE_N, BLOCK_SIZE_K: the whole matrix width); on a
GPU the tiles are vLLM's default config for small batches.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels import instrument
from kernels._env import INTERPRETED
from kernels.config import check_dtypes, next_pow2
from kernels.moe_align_block_size import moe_align_block_size


@dataclass(frozen=True)
class MoEConfig:
    block_size_m: int
    block_size_n: int
    block_size_k: int
    num_warps: int = 4


def choose_moe_config(num_tokens: int, n: int, k: int, device: torch.device) -> tuple[MoEConfig, str]:
    """Tile sizes for one GEMM of N outputs over K inputs, and why."""
    if INTERPRETED or device.type != "cuda":
        return (MoEConfig(16, max(16, next_pow2(n)), max(16, next_pow2(k))),
                "interpreter: one program per 16-row expert block, all columns at once (Python per Triton op)")
    if num_tokens <= 64:
        return MoEConfig(16, 64, 64), "GPU, few tokens: 16-row blocks waste the least padding"
    return MoEConfig(64, 64, 32, 4), "GPU: vLLM's default fused_moe config for unquantised weights"


@triton.jit
def _fused_moe_kernel(
    a_ptr, b_ptr, c_ptr, topk_weights_ptr, sorted_token_ids_ptr, expert_ids_ptr, num_tokens_post_padded_ptr,
    bias_ptr, N, K, num_valid_tokens, swiglu_alpha, swiglu_limit,
    stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn, stride_bias_e,
    top_k: tl.constexpr, SILU_AND_MUL: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr,
    BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_SIZE_M >= tl.load(num_tokens_post_padded_ptr):
        return  # past the last expert block
    offs_token = tl.load(sorted_token_ids_ptr + pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M)).to(tl.int64)
    token_mask = offs_token < num_valid_tokens  # padding rows hold num_valid_tokens
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N).to(tl.int64)
    n_mask = offs_n < N
    c = c_ptr + offs_token[:, None] * stride_cm + offs_n[None, :] * stride_cn
    if expert == -1:  # another rank's expert (expert parallelism): this rank adds nothing
        tl.store(c, tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=c_ptr.dtype.element_ty),
                 mask=token_mask[:, None] & n_mask[None, :])
        return
    a_rows = a_ptr + (offs_token // top_k)[:, None] * stride_am  # a pair's token row of A
    b_cols = b_ptr + expert * stride_be + offs_n[None, :] * stride_bn
    acc = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_SIZE_K):
        offs_k = k0 + tl.arange(0, BLOCK_SIZE_K)
        k_mask = offs_k < K
        a = tl.load(a_rows + offs_k[None, :] * stride_ak, mask=token_mask[:, None] & k_mask[None, :], other=0.0)
        b_mask = k_mask[:, None] & n_mask[None, :]
        b = tl.load(b_cols + offs_k[:, None] * stride_bk, mask=b_mask, other=0.0)
        acc += tl.dot(a, b, input_precision=DOT_PRECISION)
        if SILU_AND_MUL:  # the up projection's column n is row N + n of w13
            up = tl.load(b_cols + N * stride_bn + offs_k[:, None] * stride_bk, mask=b_mask, other=0.0)
            acc_up += tl.dot(a, up, input_precision=DOT_PRECISION)
    if HAS_BIAS:  # the expert's bias of these columns (and of their up columns)
        bias_cols = bias_ptr + expert * stride_bias_e + offs_n
        acc += tl.load(bias_cols, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        if SILU_AND_MUL:
            acc_up += tl.load(bias_cols + N, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if SILU_AND_MUL:
        if ACTIVATION == "swigluoai":
            gate_c = tl.minimum(acc, swiglu_limit)
            up_c = tl.minimum(tl.maximum(acc_up, -swiglu_limit), swiglu_limit)
            acc = (up_c + 1) * (gate_c * tl.sigmoid(gate_c * swiglu_alpha))
        else:
            acc = acc * tl.sigmoid(acc) * acc_up
    if MUL_ROUTED_WEIGHT:
        w = tl.load(topk_weights_ptr + offs_token, mask=token_mask, other=0.0)
        acc = acc * w[:, None]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=token_mask[:, None] & n_mask[None, :])


@dataclass(frozen=True)
class Activation:
    """The experts' gated activation: "silu" (SwiGLU) or "swigluoai" (gpt-oss's clamped SwiGLU)."""

    name: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0


def invoke_fused_moe_kernel(name: str, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, topk_weights: torch.Tensor,
                            aligned: tuple, top_k: int, silu_and_mul: bool, config: MoEConfig, reason: str,
                            bias: torch.Tensor | None = None, activation: Activation = Activation()) -> None:
    """One grouped GEMM: c[pair] = a[pair // top_k] · b[expert]^T (+ bias[expert]) (see the module docstring)."""
    sorted_ids, expert_ids, post_padded = aligned
    n = b.shape[1] // 2 if silu_and_mul else b.shape[1]
    grid = (expert_ids.shape[0], triton.cdiv(n, config.block_size_n))
    args = dict(a_ptr=a, b_ptr=b, c_ptr=c, topk_weights_ptr=topk_weights, sorted_token_ids_ptr=sorted_ids,
                expert_ids_ptr=expert_ids, num_tokens_post_padded_ptr=post_padded, bias_ptr=bias, N=n, K=b.shape[2],
                num_valid_tokens=c.shape[0], swiglu_alpha=activation.swiglu_alpha,
                swiglu_limit=activation.swiglu_limit, stride_am=a.stride(0), stride_ak=a.stride(1),
                stride_be=b.stride(0), stride_bn=b.stride(1), stride_bk=b.stride(2), stride_cm=c.stride(0),
                stride_cn=c.stride(1), stride_bias_e=bias.stride(0) if bias is not None else 0)
    meta = dict(top_k=top_k, SILU_AND_MUL=silu_and_mul, MUL_ROUTED_WEIGHT=not silu_and_mul,
                BLOCK_SIZE_M=config.block_size_m, BLOCK_SIZE_N=config.block_size_n,
                BLOCK_SIZE_K=config.block_size_k, num_warps=config.num_warps,
                # fp32 weights: tl.dot would otherwise round inputs to tf32 on GPUs (~1e-3 relative error)
                DOT_PRECISION="ieee" if b.dtype == torch.float32 else "tf32",
                HAS_BIAS=bias is not None, ACTIVATION=activation.name)
    info = expert_load(aligned, b.shape[0], config.block_size_m, c.shape[0]) if instrument.observed() else None
    instrument.launch(name, _fused_moe_kernel, grid, args, meta, reason=reason, access=expert_blocks,
                      access_args=(sorted_ids, expert_ids, post_padded, c.shape[0], top_k, config.block_size_m,
                                   grid[1]), info=info)


def expert_load(aligned: tuple, num_experts: int, block_size_m: int, num_pairs: int) -> dict:
    """What a launch record says of the expert blocks: how many blocks each expert got, how many
    experts some token chose (the weights the launch reads) and how many rows are padding."""
    _, expert_ids, post_padded = aligned
    total = int(post_padded[0])
    ids = expert_ids[:total // block_size_m].long()
    blocks = torch.bincount(ids[ids >= 0], minlength=num_experts)  # -1: another rank's expert
    return dict(expert_blocks=blocks.tolist(), experts_used=int((blocks > 0).sum()), padding_rows=total - num_pairs)


def fused_moe(hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, expert_map: torch.Tensor | None = None, *,
              config: MoEConfig | None = None, w13_bias: torch.Tensor | None = None,
              w2_bias: torch.Tensor | None = None, activation: str = "silu", swiglu_alpha: float = 1.702,
              swiglu_limit: float = 7.0) -> torch.Tensor:
    """Triton version of :func:`kernels.reference.fused_moe_ref`: hidden_states [T, H], w13
    [E, 2I, H] (gate rows, then up rows), w2 [E, H, I], topk_weights and topk_ids [T, top_k]
    -> [T, H] = Σ_k weight_k · w2[e_k] · (silu(gate[e_k] · x) · up[e_k] · x). expert_map
    (expert parallelism): topk_ids are global, w13 and w2 this rank's experts only, indexed by
    expert_map[global id]; other ranks' experts add nothing here. w13_bias [E, 2I], w2_bias
    [E, H] and activation="swigluoai" (with its alpha and limit): gpt-oss's experts."""
    T, H = hidden_states.shape
    I2 = w13.shape[1]
    E = w13.shape[0] if expert_map is None else expert_map.shape[0]
    top_k = topk_ids.shape[1]
    check_dtypes(hidden_states, w13, w2)
    if activation not in ("silu", "swigluoai"):
        raise ValueError(f"activation must be 'silu' or 'swigluoai', got {activation!r}")
    out = hidden_states.new_empty(T, H)
    if T == 0:
        return out
    reason = "caller-supplied config"
    if config is None:
        config, reason = choose_moe_config(T * top_k, max(I2 // 2, H), max(H, I2 // 2), hidden_states.device)
    aligned = moe_align_block_size(topk_ids, config.block_size_m, E, expert_map)
    weights = topk_weights.to(torch.float32).contiguous()
    act = Activation(activation, swiglu_alpha, swiglu_limit)
    inter = hidden_states.new_empty(T * top_k, I2 // 2)
    invoke_fused_moe_kernel("fused_moe_w13", hidden_states, w13, inter, weights, aligned, top_k, True, config, reason,
                            w13_bias, act)
    down = hidden_states.new_empty(T * top_k, H)
    invoke_fused_moe_kernel("fused_moe_w2", inter, w2, down, weights, aligned, 1, False, config, reason, w2_bias)
    return torch.sum(down.view(T, top_k, H), dim=1, out=out)  # vLLM's moe_sum


def expert_blocks(sorted_ids, expert_ids, post_padded, num_valid, top_k, block_m, grid_n
                  ) -> list[instrument.ProgramAccess]:
    """Per program: its block's rows of the sorted order [start, end) and, in ``blocks``, the
    expert whose weights it reads. Blocks past num_tokens_post_padded return at once: absent."""
    experts, total = expert_ids.tolist(), int(post_padded[0])
    return [instrument.ProgramAccess((m, n, 0), None, (m * block_m, (m + 1) * block_m), (), (experts[m],))
            for m in range(total // block_m) for n in range(grid_n)]
