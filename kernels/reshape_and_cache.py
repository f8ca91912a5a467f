"""Cache write: scatter this step's K and V into their slots of the paged cache (Triton).

Each program copies a [tokens, heads * head_size] tile: it reads each token's slot, splits it
into (physical block, offset) and stores the token's heads there. Negative slots are padding.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import instrument
from kernels.config import CacheConfig, check_dtypes, choose_cache_config


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
    num_tokens,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    NUM_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    TOKENS: tl.constexpr, BLOCK_HD: tl.constexpr,
):
    # int64 index math: slot * stride can overflow int32 for big caches, and the interpreter
    # skips its costly int32 overflow checks.
    toks = tl.program_id(0).to(tl.int64) * TOKENS + tl.arange(0, TOKENS)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_HD + tl.arange(0, BLOCK_HD)
    head = cols // HEAD_SIZE
    dim = cols % HEAD_SIZE
    slot = tl.load(slot_mapping_ptr + toks, mask=toks < num_tokens, other=-1).to(tl.int64)
    ok = (slot >= 0)[:, None] & (cols < NUM_HEADS * HEAD_SIZE)[None, :]
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    t = toks[:, None]
    k = tl.load(key_ptr + t * stride_kt + head[None, :] * stride_kh + dim[None, :], mask=ok)
    v = tl.load(value_ptr + t * stride_vt + head[None, :] * stride_vh + dim[None, :], mask=ok)
    # tl.store casts to the cache's element type, as the reference's .to(cache.dtype) does.
    kc = key_cache_ptr + (block * stride_kcb + offset * stride_kcs)[:, None] + head[None, :] * stride_kch
    vc = value_cache_ptr + (block * stride_vcb + offset * stride_vcs)[:, None] + head[None, :] * stride_vch
    tl.store(kc + dim[None, :], k, mask=ok)
    tl.store(vc + dim[None, :], v, mask=ok)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    config: CacheConfig | None = None,
) -> None:
    """Triton version of :func:`kernels.reference.reshape_and_cache_ref` (same semantics)."""
    num_tokens, num_heads, head_size = key.shape
    block_size = key_cache.shape[1]
    for t in (key, value, key_cache, value_cache):
        assert t.stride(-1) == 1, "the head dimension must be contiguous"
    check_dtypes(key, value, key_cache, value_cache)
    if num_tokens == 0:
        return
    reason = "caller-supplied config"
    if config is None:
        config, reason = choose_cache_config(
            num_tokens=num_tokens, num_kv_heads=num_heads, head_size=head_size, device=key.device
        )
    grid = (triton.cdiv(num_tokens, config.tokens_per_program), triton.cdiv(num_heads * head_size, config.block_hd))
    args = dict(
        key_ptr=key, value_ptr=value, key_cache_ptr=key_cache, value_cache_ptr=value_cache,
        slot_mapping_ptr=slot_mapping, num_tokens=num_tokens,
        stride_kt=key.stride(0), stride_kh=key.stride(1), stride_vt=value.stride(0), stride_vh=value.stride(1),
        stride_kcb=key_cache.stride(0), stride_kcs=key_cache.stride(1), stride_kch=key_cache.stride(2),
        stride_vcb=value_cache.stride(0), stride_vcs=value_cache.stride(1), stride_vch=value_cache.stride(2),
    )
    meta = dict(
        NUM_HEADS=num_heads, HEAD_SIZE=head_size, BLOCK_SIZE=block_size,
        TOKENS=config.tokens_per_program, BLOCK_HD=config.block_hd, num_warps=config.num_warps,
    )
    instrument.launch(
        "reshape_and_cache", _reshape_and_cache_kernel, grid, args, meta,
        reason=reason, access=_access_map, access_args=(slot_mapping, config, num_heads, head_size, block_size),
    )


def _access_map(slot_mapping, config, num_heads, head_size, block_size) -> list[instrument.ProgramAccess]:
    slots = slot_mapping.tolist()
    out = []
    tp, hd = config.tokens_per_program, config.block_hd
    for x in range(triton.cdiv(len(slots), tp)):
        rows = (x * tp, min(len(slots), (x + 1) * tp))
        blocks = tuple(dict.fromkeys(s // block_size for s in slots[rows[0]:rows[1]] if s >= 0))
        for y in range(triton.cdiv(num_heads * head_size, hd)):
            heads = tuple(range(y * hd // head_size, min(num_heads, triton.cdiv((y + 1) * hd, head_size))))
            if blocks:
                out.append(instrument.ProgramAccess((x, y, 0), None, rows, heads, blocks))
    return out
