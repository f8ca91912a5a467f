"""Unified paged attention (Triton): one kernel for prefill, decode and mixed batches (vLLM v1).

Queries are the flattened new tokens of all requests; keys and values come from the paged cache
through each request's block table (this step's tokens were written there first).

* Query blocks: BLOCK_Q consecutive query tokens of one request. Request r's blocks are numbered
  from ``qsl[r] // BLOCK_Q + r`` (the ``+ r`` absorbs each request's partial last block), so the
  grid size needs no device data. A small device-side map (one searchsorted) gives each block
  its request and first token row.
* Grid (query-block groups, KV-head groups[, KV segments]). A program handles Q_BLOCKS query
  blocks and HEADS_PER_PROG KV heads with all their GQA query heads. Its rows are (query block,
  token, query head); the columns of its q/k/v tiles are (KV head, dim), HEAD_PAD per head; its
  score columns are (query block, key in tile). Masks keep each row to its own head's columns
  and its own query block's keys ("block-diagonal"), so plain 2-D dots do all the work. The GPU
  config uses one head and one query block (the usual flash-attention tile); the interpreter
  stacks many, because there every operation costs the same regardless of tile size.
* Each loop iteration gathers TILE_N keys per query block (TILE_N / BLOCK_SIZE block-table
  entries at once) and runs an fp32 online softmax under the causal mask
  ``key_pos <= context_len + query_index``.
* Sliding window (SLIDING_WINDOW > 0, Mistral, Gemma 3's local layers): a query at position p
  also masks keys at or before ``p - SLIDING_WINDOW``, and a program starts at the tile of the
  first key its first query reads: the tiles before, whose blocks the scheduler may already have
  given to another request (the table holds the null block there), are never loaded.
* Attention sinks (gpt-oss): a learned logit per query head joins each row's softmax as one more
  column with no value, so a row may give part of its weight to nothing. The online softmax
  starts from it (running max = the sink, exp-sum = 1) instead of from empty; under split-KV only
  segment 0 does, so the merge counts it once.
* Split-KV (flash-decoding): a third grid axis cuts the tiles into segments; each program writes
  its unnormalised accumulator, running max and exp-sum, and a reduce kernel merges them.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import instrument
from kernels._env import INTERPRETED
from kernels.config import (
    MIN_COMPILED_SCORE_COLUMNS,
    AttentionConfig,
    check_dtypes,
    choose_config,
    head_tile,
    next_pow2,
    num_query_blocks,
)

_NEG = tl.constexpr(-1.0e30)  # finite "minus infinity" for running maxima: exp(_NEG - _NEG) is 1, not nan


@triton.jit
def _key_columns(qb0, rows, qb_req_ptr, qb_start_ptr, query_start_loc_ptr, seq_lens_ptr, num_q_blocks,
                 BLOCK_Q: tl.constexpr, QH_PAD: tl.constexpr, Q_BLOCKS: tl.constexpr, TILE_N: tl.constexpr):
    """Score columns are (query block, key in tile): each query block of the program gathers its own
    request's keys, and a row only sees the columns of its own query block (same_qb). Per column: its key
    in the tile, request (-1: an idle block), that request's query block start and query end, and how many
    keys the block's rows can see (none past its last row's causal limit)."""
    offs_n = tl.arange(0, Q_BLOCKS * TILE_N).to(tl.int64)
    col_qb = qb0 + offs_n // TILE_N
    col_req = tl.load(qb_req_ptr + col_qb, mask=col_qb < num_q_blocks, other=-1)
    col_has = col_req >= 0
    col_end = tl.load(query_start_loc_ptr + col_req + 1, mask=col_has, other=0)
    col_start = tl.load(qb_start_ptr + col_qb, mask=col_has, other=0)
    kv_len = tl.minimum(col_start + BLOCK_Q, col_end) + tl.load(seq_lens_ptr + col_req, mask=col_has, other=0) - col_end
    same_qb = (rows // (BLOCK_Q * QH_PAD))[:, None] == (offs_n // TILE_N)[None, :]
    return offs_n % TILE_N, same_qb, col_req, col_has, col_start, col_end, kv_len


@triton.jit
def _attend_tile(q, m_i, l_i, acc, k_pos, key_cache_ptr, value_cache_ptr, bt_row, kv_len, k_cols, v_cols, col_ok,
                 same_qb, q_pos, scale, stride_kb, stride_ks, stride_vb, stride_vs,
                 BLOCK_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr, SLIDING_WINDOW: tl.constexpr):
    """One tile of keys (positions k_pos, per score column) folded into the online softmax: the running
    max m_i, exp-sum l_i and unnormalised output acc of every row."""
    k_ok = k_pos < kv_len
    # One block-table entry per key: the tile covers TILE_N / BLOCK_SIZE entries at once.
    phys = tl.load(bt_row + k_pos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
    in_block = k_pos % BLOCK_SIZE
    kv_mask = k_ok[None, :] & col_ok[:, None]
    k_ptrs = key_cache_ptr + (phys * stride_kb + in_block * stride_ks)[None, :] + k_cols[:, None]
    k = tl.load(k_ptrs, mask=kv_mask, other=0.0)  # [WIDTH, Q_BLOCKS * TILE_N]
    s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale  # fp32
    visible = same_qb & (k_pos[None, :] <= q_pos[:, None]) & k_ok[None, :]
    if SLIDING_WINDOW > 0:
        visible = visible & (k_pos[None, :] > q_pos[:, None] - SLIDING_WINDOW)
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp(s - m_new[:, None])
    alpha = tl.exp(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    v_ptrs = value_cache_ptr + (phys * stride_vb + in_block * stride_vs)[:, None] + v_cols[None, :]
    v = tl.load(v_ptrs, mask=tl.trans(kv_mask), other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _attention_kernel(
    out_ptr, query_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    qb_req_ptr, qb_start_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, sinks_ptr,
    scale, num_q_blocks, num_q_heads, tiles_per_segment,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, GROUP: tl.constexpr, HEADS_PER_PROG: tl.constexpr,
    QH_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, Q_BLOCKS: tl.constexpr,
    TILE_N: tl.constexpr, NUM_SEGMENTS: tl.constexpr, DOT_PRECISION: tl.constexpr, SLIDING_WINDOW: tl.constexpr,
    USE_SINKS: tl.constexpr,
):
    # Index math is int64: no overflow for big caches, and the interpreter skips its (costly)
    # int32 overflow checks.
    BLOCK_M: tl.constexpr = Q_BLOCKS * BLOCK_Q * QH_PAD
    WIDTH: tl.constexpr = HEADS_PER_PROG * HEAD_PAD
    QH: tl.constexpr = HEADS_PER_PROG * GROUP  # query heads per program (QH_PAD: next power of 2)
    qb0 = tl.program_id(0).to(tl.int64) * Q_BLOCKS
    kv_head0 = tl.program_id(1).to(tl.int64) * HEADS_PER_PROG

    # Rows are (query block, token in block, query head); columns of q/k/v are (KV head, dim).
    rows = tl.arange(0, BLOCK_M).to(tl.int64)
    row_qb = qb0 + rows // (BLOCK_Q * QH_PAD)
    row_head = rows % QH_PAD
    row_req = tl.load(qb_req_ptr + row_qb, mask=row_qb < num_q_blocks, other=-1)
    has_req = row_req >= 0  # idle query blocks map to request -1 (see _query_block_map)
    tok = tl.load(qb_start_ptr + row_qb, mask=has_req, other=0) + (rows // QH_PAD) % BLOCK_Q
    q_end = tl.load(query_start_loc_ptr + row_req + 1, mask=has_req, other=0)
    q_pos = tok + tl.load(seq_lens_ptr + row_req, mask=has_req, other=0) - q_end  # absolute position
    row_ok = (tok < q_end) & (row_head < QH)
    cols = tl.arange(0, WIDTH).to(tl.int64)
    col_head = cols // HEAD_PAD
    dim = cols % HEAD_PAD
    col_ok = dim < HEAD_SIZE
    # Block-diagonal: row r holds its query only in its own KV head's columns, so one dot
    # scores every row against its own head.
    mine = ((row_head // GROUP)[:, None] == col_head[None, :]) & row_ok[:, None] & col_ok[None, :]
    q_head = kv_head0 * GROUP + row_head
    q = tl.load(query_ptr + tok[:, None] * stride_qt + q_head[:, None] * stride_qh + dim[None, :], mask=mine, other=0.0)
    q = q.to(key_cache_ptr.dtype.element_ty)

    in_tile, same_qb, col_req, col_has, col_start, col_end, kv_len = _key_columns(
        qb0, rows, qb_req_ptr, qb_start_ptr, query_start_loc_ptr, seq_lens_ptr, num_q_blocks, BLOCK_Q, QH_PAD,
        Q_BLOCKS, TILE_N)
    bt_row = block_tables_ptr + col_req * stride_bt
    num_tiles = (tl.max(kv_len, 0) + TILE_N - 1) // TILE_N
    if NUM_SEGMENTS > 1:
        tile_lo = tl.program_id(2) * tiles_per_segment
        tile_hi = tl.minimum(tile_lo + tiles_per_segment, num_tiles)
    else:
        tile_lo = 0
        tile_hi = num_tiles
    if SLIDING_WINDOW > 0:  # skip the tiles wholly before the window of the program's earliest query
        first_key = col_start + tl.load(seq_lens_ptr + col_req, mask=col_has, other=0) - col_end - SLIDING_WINDOW + 1
        first_key = tl.min(tl.where(col_has, first_key, 1 << 40), 0)
        tile_lo = tl.maximum(tile_lo, tl.maximum(first_key, 0) // TILE_N)

    k_cols = (kv_head0 + col_head) * stride_kh + dim
    v_cols = (kv_head0 + col_head) * stride_vh + dim
    m_i = tl.full([BLOCK_M], _NEG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if USE_SINKS:  # the sink's column: exp(sink - m) with m = sink; segment 0 only (axis 2 is 1 wide without split-KV)
        has_sink = row_ok & (tl.zeros_like(row_head) + tl.program_id(2) == 0)
        m_i = tl.load(sinks_ptr + q_head, mask=has_sink, other=_NEG).to(tl.float32)
        l_i = tl.where(has_sink, 1.0, 0.0)
    acc = tl.zeros([BLOCK_M, WIDTH], tl.float32)
    for t in range(tile_lo, tile_hi):
        k_pos = t * TILE_N + in_tile
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, k_pos, key_cache_ptr, value_cache_ptr, bt_row, kv_len, k_cols, v_cols, col_ok, same_qb,
            q_pos, scale, stride_kb, stride_ks, stride_vb, stride_vs, BLOCK_SIZE, DOT_PRECISION, SLIDING_WINDOW)

    # Off-diagonal columns of acc mix in other heads' values; the `mine` mask drops them.
    if NUM_SEGMENTS > 1:
        part = (tok * num_q_heads + q_head) * NUM_SEGMENTS + tl.program_id(2)
        tl.store(part_acc_ptr + part[:, None] * HEAD_PAD + dim[None, :], acc, mask=mine)
        tl.store(part_max_ptr + part, m_i, mask=row_ok)
        tl.store(part_sum_ptr + part, l_i, mask=row_ok)
    else:
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + tok[:, None] * stride_ot + q_head[:, None] * stride_oh + dim[None, :], o, mask=mine)


@triton.jit
def _reduce_segments_kernel(
    out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr,
    num_q_heads, stride_ot, stride_oh,
    HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, HEADS_BLOCK: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr, SEG_PAD: tl.constexpr,
):
    """out = sum_s acc_s * exp(m_s - M) / sum_s l_s * exp(m_s - M), M = max_s m_s."""
    tok = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * HEADS_BLOCK + tl.arange(0, HEADS_BLOCK)
    segs = tl.arange(0, SEG_PAD)
    dim = tl.arange(0, HEAD_PAD)
    ok = (heads < num_q_heads)[:, None] & (segs < NUM_SEGMENTS)[None, :]
    part = (tok * num_q_heads + heads)[:, None] * NUM_SEGMENTS + segs[None, :]  # [HEADS_BLOCK, SEG_PAD]
    m = tl.load(part_max_ptr + part, mask=ok, other=_NEG)
    l = tl.load(part_sum_ptr + part, mask=ok, other=0.0)  # noqa: E741 (l: the softmax sum, as in FlashAttention)
    w = tl.exp(m - tl.max(m, 1)[:, None])
    denom = tl.sum(l * w, 1)
    # Padding dims were never written (torch.empty): mask them so garbage cannot become nan.
    acc_ok = ok[:, :, None] & (dim < HEAD_SIZE)[None, None, :]
    acc = tl.load(part_acc_ptr + part[:, :, None] * HEAD_PAD + dim[None, None, :], mask=acc_ok, other=0.0)
    o = tl.sum(acc * w[:, :, None], 1) / tl.where(denom == 0.0, 1.0, denom)[:, None]
    dst = out_ptr + tok * stride_ot + heads[:, None] * stride_oh + dim[None, :]
    tl.store(dst, o, mask=(heads < num_q_heads)[:, None] & (dim < HEAD_SIZE)[None, :])


def _query_block_map(query_start_loc: torch.Tensor, num_q_blocks: int, block_q: int):
    """Query block -> (request, first token row), or request -1 for idle blocks.

    Computed on the device with a searchsorted over each request's first block number, so no
    host sync; the kernel then needs one load per lane instead of a binary search (which costs
    dozens of operations per program under the interpreter).
    """
    qsl = query_start_loc.long()
    starts, ends = qsl[:-1], qsl[1:]
    first = starts // block_q
    if block_q > 1:
        first = first + torch.arange(len(starts), device=qsl.device)
    qb = torch.arange(num_q_blocks, device=qsl.device)
    req = (torch.searchsorted(first, qb, right=True) - 1).clamp_(min=0)
    start = starts[req] + (qb - first[req]) * block_q
    return torch.where(start < ends[req], req, -1), start


def unified_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    config: AttentionConfig | None = None,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton version of :func:`kernels.reference.unified_attention_ref` (same semantics).

    Pass max_query_len / max_seq_len when known: computing them reads device memory (a sync).
    ``sinks`` [num_q_heads]: each query head's sink logit (None: no sink, and nothing to pay for it).
    ``config`` overrides :func:`kernels.config.choose_config` (tests use it to force split-KV).
    """
    num_tokens, num_q_heads, head_size = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    _check_inputs(query, key_cache, value_cache, block_tables, sinks)
    if out is None:
        out = torch.empty_like(query)
    assert out.stride(-1) == 1
    if num_tokens == 0 or num_seqs == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    reason = "caller-supplied config"
    if config is None:
        config, reason = choose_config(
            num_tokens=num_tokens, num_seqs=num_seqs, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
            head_size=head_size, block_size=block_size, max_query_len=max_query_len, max_seq_len=max_seq_len,
            device=query.device,
        )
    if not INTERPRETED and config.q_blocks_per_program * config.tile_n < MIN_COMPILED_SCORE_COLUMNS:
        raise ValueError(f"compiled kernels need q_blocks_per_program * tile_n >= {MIN_COMPILED_SCORE_COLUMNS} "
                         f"(see kernels.config.MIN_COMPILED_SCORE_COLUMNS), got {config}")
    assert num_kv_heads % config.heads_per_program == 0, "heads_per_program must divide the number of KV heads"
    part_acc, part_max, part_sum = _launch_attention(query, key_cache, value_cache, query_start_loc, seq_lens,
                                                     block_tables, scale, out, config, reason, max_seq_len,
                                                     sliding_window, sinks)
    if config.num_segments > 1:
        _launch_reduce(out, part_acc, part_max, part_sum, config)
    return out


def _check_inputs(query, key_cache, value_cache, block_tables, sinks) -> None:
    num_q_heads, num_kv_heads = query.shape[1], key_cache.shape[2]
    assert num_q_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads"
    for t in (query, key_cache, value_cache, block_tables):
        assert t.stride(-1) == 1, "the last dimension must be contiguous"
    check_dtypes(query, key_cache, value_cache)
    assert sinks is None or tuple(sinks.shape) == (num_q_heads,) and sinks.is_contiguous(), "one sink per query head"


def _launch_attention(query, key_cache, value_cache, query_start_loc, seq_lens, block_tables, scale, out,
                      config: AttentionConfig, reason: str, max_seq_len: int, sliding_window, sinks):
    """The attention kernel's launch; returns split-KV's partial results (acc, max, sum), or out three
    times when there is one segment (the kernel then writes out directly)."""
    num_tokens, num_q_heads, head_size = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_q_heads // num_kv_heads
    hp, segments = config.heads_per_program, config.num_segments
    head_pad = head_tile(head_size)
    num_q_blocks = num_query_blocks(num_tokens, seq_lens.shape[0], config.block_q)
    qb_req, qb_start = _query_block_map(query_start_loc, num_q_blocks, config.block_q)
    tiles_per_segment = triton.cdiv(triton.cdiv(max_seq_len, config.tile_n), segments)
    if segments > 1:
        part_acc = torch.empty(num_tokens, num_q_heads, segments, head_pad, dtype=torch.float32, device=query.device)
        part_max = torch.empty(num_tokens, num_q_heads, segments, dtype=torch.float32, device=query.device)
        part_sum = torch.empty_like(part_max)
    else:
        part_acc = part_max = part_sum = out  # unused: the NUM_SEGMENTS == 1 branch is compiled out
    grid = (triton.cdiv(num_q_blocks, config.q_blocks_per_program), num_kv_heads // hp, segments)
    args = dict(
        out_ptr=out, query_ptr=query, key_cache_ptr=key_cache, value_cache_ptr=value_cache,
        block_tables_ptr=block_tables, seq_lens_ptr=seq_lens, query_start_loc_ptr=query_start_loc,
        qb_req_ptr=qb_req, qb_start_ptr=qb_start, part_acc_ptr=part_acc, part_max_ptr=part_max, part_sum_ptr=part_sum,
        sinks_ptr=sinks, scale=scale, num_q_blocks=num_q_blocks, num_q_heads=num_q_heads,
        tiles_per_segment=tiles_per_segment,
        stride_qt=query.stride(0), stride_qh=query.stride(1), stride_ot=out.stride(0), stride_oh=out.stride(1),
        stride_kb=key_cache.stride(0), stride_ks=key_cache.stride(1), stride_kh=key_cache.stride(2),
        stride_vb=value_cache.stride(0), stride_vs=value_cache.stride(1), stride_vh=value_cache.stride(2),
        stride_bt=block_tables.stride(0),
    )
    meta = dict(
        HEAD_SIZE=head_size, HEAD_PAD=head_pad, GROUP=group, HEADS_PER_PROG=hp, QH_PAD=next_pow2(hp * group),
        BLOCK_SIZE=block_size, BLOCK_Q=config.block_q, Q_BLOCKS=config.q_blocks_per_program,
        TILE_N=config.tile_n, NUM_SEGMENTS=segments, SLIDING_WINDOW=sliding_window or 0, USE_SINKS=sinks is not None,
        # fp32 caches: tl.dot would otherwise round inputs to tf32 on GPUs (~1e-3 relative error).
        DOT_PRECISION="ieee" if key_cache.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    instrument.launch(
        "unified_attention" if segments == 1 else "unified_attention_split_kv",
        _attention_kernel, grid, args, meta, reason=reason, access=_access_map,
        access_args=(query_start_loc, seq_lens, block_tables, config, num_kv_heads, block_size, num_tokens, group,
                     sliding_window or 0),
    )
    return part_acc, part_max, part_sum


def _launch_reduce(out: torch.Tensor, part_acc: torch.Tensor, part_max: torch.Tensor, part_sum: torch.Tensor,
                   config: AttentionConfig) -> None:
    """Split-KV's second kernel: each (token, head)'s segments merged into out."""
    num_tokens, num_q_heads, head_size = out.shape
    segments, heads_block = config.num_segments, config.reduce_heads_per_program
    instrument.launch(
        "reduce_segments", _reduce_segments_kernel, (num_tokens, triton.cdiv(num_q_heads, heads_block)),
        dict(out_ptr=out, part_acc_ptr=part_acc, part_max_ptr=part_max, part_sum_ptr=part_sum,
             num_q_heads=num_q_heads, stride_ot=out.stride(0), stride_oh=out.stride(1)),
        dict(HEAD_SIZE=head_size, HEAD_PAD=head_tile(head_size), HEADS_BLOCK=heads_block,
             NUM_SEGMENTS=segments, SEG_PAD=next_pow2(segments), num_warps=4),
        reason=f"merge {segments} KV segments per (token, head)",
    )


def _access_map(query_start_loc, seq_lens, block_tables, config, num_kv_heads, block_size, num_tokens, group=1,
                sliding_window=0):
    """Replay the kernel's program -> work mapping on the host, from the launch's metadata.
    group = num_queries_per_kv: the program of KV heads [a, b) does query heads [a·group, b·group).
    With a sliding window a program starts at the tile of its earliest query's first key."""
    qsl, lens, tables = query_start_loc.tolist(), seq_lens.tolist(), block_tables.tolist()  # one copy each
    bq, qbp, hp, tile = config.block_q, config.q_blocks_per_program, config.heads_per_program, config.tile_n
    nseg = config.num_segments
    tiles_per_segment = triton.cdiv(triton.cdiv(max(lens), tile), nseg)
    # Query blocks of each program, as (request, [first row, end row), keys needed).
    work: dict[int, list[tuple[int, int, int, int]]] = {}
    for r, seq_len in enumerate(lens):
        q_len = qsl[r + 1] - qsl[r]
        first = qsl[r] // bq + (r if bq > 1 else 0)
        for local in range(triton.cdiv(q_len, bq)):
            end = min((local + 1) * bq, q_len)
            work.setdefault((first + local) // qbp, []).append(
                (r, qsl[r] + local * bq, qsl[r] + end, seq_len - q_len + end)
            )
    out = []
    for x, blocks_of_program in sorted(work.items()):
        # A program runs as many tiles as its longest query block needs.
        tiles = triton.cdiv(max(kv for *_, kv in blocks_of_program), tile)
        first_tile = 0
        if sliding_window:  # the first query of a block sits at kv_len - (row1 - row0)
            first_tile = max(0, min(kv - (r1 - r0) - sliding_window + 1 for _, r0, r1, kv in blocks_of_program)) // tile
        for seg in range(nseg):
            lo = seg * tiles_per_segment if nseg > 1 else 0
            hi = min(lo + tiles_per_segment, tiles) if nseg > 1 else tiles
            lo = max(lo, first_tile)
            if lo >= hi and sliding_window:
                continue  # a segment wholly before the window loads nothing
            for r, row0, row1, kv_len in blocks_of_program:
                pos = (min(lo * tile, kv_len), min(hi * tile, kv_len))
                logical = range(pos[0] // block_size, triton.cdiv(pos[1], block_size))
                blocks = tuple(tables[r][b] for b in logical)
                for y in range(num_kv_heads // hp):
                    out.append(instrument.ProgramAccess(
                        (x, y, seg), r, (row0, row1), tuple(range(y * hp, (y + 1) * hp)), blocks,
                        kv_positions=pos, segment=seg if nseg > 1 else None,
                        q_heads=tuple(range(y * hp * group, (y + 1) * hp * group)),
                    ))
    return out
