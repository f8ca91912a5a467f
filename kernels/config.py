"""Launch configurations: one place that decides tile sizes and programs-per-launch, with reasons.

The interpreter and a GPU want opposite things. A GPU runs thousands of programs in parallel, so
we want many small programs (one KV head and one query block each, small tiles) and, for short
decode batches, extra programs from splitting the KV sequence. The interpreter runs programs one
after another and every Triton operation costs ~0.1 ms of Python regardless of the tensor size,
so we want few, fat programs: all KV heads, many query blocks (of different requests) and a KV
tile covering the whole context, i.e. one program and one loop iteration for a small decode step.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels._env import INTERPRETED


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def check_dtypes(*tensors: torch.Tensor) -> None:
    """The interpreter computes with numpy, which has no bfloat16: it would return garbage."""
    if INTERPRETED and any(t.dtype == torch.bfloat16 for t in tensors):
        raise TypeError("the Triton interpreter has no bfloat16: use float16/float32, or the torch backend")


def head_tile(head_size: int) -> int:
    """Columns per head in the kernels' tiles: a power of two (Triton tiles must be), >= 16
    (tl.dot's minimum on GPUs); e.g. 80 -> 128, with the padding masked off."""
    return max(16, next_pow2(head_size))


#: Compiled (GPU) kernels need at least this many score columns per program
#: (q_blocks_per_program * tile_n): with 16, Triton 3.6 fails to compile the attention kernel
#: on an H100 ("'tt.load' op failed to verify that mask type matches ptr type", in the layout
#: pass), whatever the rows, heads or dtype; 32 and up compile and match the reference. The
#: configs choose_config gives a GPU never go below it; caller-supplied ones are checked.
MIN_COMPILED_SCORE_COLUMNS = 32


def _pow2_divisor(n: int, cap: int) -> int:
    """Largest power of two that divides n and is <= cap."""
    d = 1
    while n % (d * 2) == 0 and d * 2 <= cap:
        d *= 2
    return d


@dataclass(frozen=True)
class AttentionConfig:
    """Meta-parameters of the attention kernel (see kernels/unified_attention.py).

    A program handles ``q_blocks_per_program`` query blocks of ``block_q`` tokens each, for
    ``heads_per_program`` KV heads and all their GQA query heads, so it has
    q_blocks_per_program * block_q * next_pow2(heads_per_program * group) rows.
    """

    block_q: int  # query tokens per query block (a query block never spans two requests)
    q_blocks_per_program: int  # query blocks stacked into one program (>1 only when interpreted)
    tile_n: int  # KV tokens per loop iteration: tile_n / block_size block-table entries at once
    heads_per_program: int  # KV heads per program
    num_segments: int = 1  # > 1: split-KV (flash-decoding), a third grid axis plus a reduce
    reduce_heads_per_program: int = 1  # query heads per program of the split-KV reduce
    num_warps: int = 4
    num_stages: int = 2


@dataclass(frozen=True)
class CacheConfig:
    tokens_per_program: int
    block_hd: int  # flattened (head, dim) elements per program
    num_warps: int = 4


def _target(device: torch.device | str | None, target: str | None, num_sms: int | None) -> tuple[str, int]:
    """('interpreter', 1) or ('cuda', number of SMs); explicit arguments win (for tests, what-ifs)."""
    if target is None:
        on_cuda = device is not None and torch.device(device).type == "cuda"
        target = "cuda" if on_cuda and not INTERPRETED else "interpreter"
    if target == "cuda" and num_sms is None:
        num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    return target, num_sms or 1


def num_query_blocks(num_tokens: int, num_seqs: int, block_q: int) -> int:
    """Upper bound on sum_r cdiv(query_len_r, block_q) that needs no device data.

    Request r's query blocks are numbered from qsl[r] // block_q + r (the + r absorbs each
    request's partial last block); with block_q == 1 blocks are tokens and no slack is needed.
    """
    return num_tokens if block_q == 1 else num_tokens // block_q + num_seqs


def choose_config(
    *,
    num_tokens: int,
    num_seqs: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    max_query_len: int,
    max_seq_len: int,
    device: torch.device | str | None = None,
    target: str | None = None,
    num_sms: int | None = None,
) -> tuple[AttentionConfig, str]:
    """Pick the attention launch configuration; returns (config, human-readable reason).

    ``target`` ("interpreter" or "cuda") and ``num_sms`` default to what ``device`` implies.
    """
    group = num_q_heads // num_kv_heads
    head_pad = head_tile(head_size)
    kind, sms = _target(device, target, num_sms)
    if kind == "interpreter":
        # Cost is per operation per program, nearly independent of tile sizes: fold every KV
        # head (rows up to 1024 wide), many query blocks (up to 256 rows) and a KV tile spanning
        # the longest context (up to 256 keys) into each program. A decode step of a small
        # batch becomes a single program with a single loop iteration.
        hp = _pow2_divisor(num_kv_heads, max(1, 1024 // head_pad))
        qh_pad = next_pow2(hp * group)
        block_q = min(next_pow2(max_query_len), max(1, 256 // qh_pad))
        tile_n = max(16, min(256, next_pow2(max_seq_len)))
        nqb = num_query_blocks(num_tokens, num_seqs, block_q)
        qbp = max(1, min(next_pow2(nqb), 256 // (block_q * qh_pad), 2048 // tile_n))
        cfg = AttentionConfig(block_q, qbp, tile_n, hp, 1, next_pow2(num_q_heads), 1, 1)
        return cfg, (
            f"interpreter: programs run one after another at a fixed cost per op, so few fat "
            f"programs: {qbp} query block(s) x {block_q} token(s) x {hp} KV head(s) per program, "
            f"{tile_n}-token KV tile ({max(1, tile_n // block_size)} block-table entries per iteration); "
            f"never split KV (more programs only add cost)"
        )
    # GPU, vLLM-style: one KV head and one query block per program, with the GQA query heads
    # stacked so a program has >= 16 rows (tl.dot's minimum); KV tile sized for registers.
    block_q = max(1, 16 // next_pow2(group))
    tile_n = 32 if head_pad > 128 else 64
    reason = f"cuda ({sms} SMs): 1 KV head x {block_q} query token(s) per program, {tile_n}-token KV tile"
    segments = 1
    if max_query_len == 1:
        # Split-KV rule: a decode-only batch whose programs cannot fill the GPU gets its KV
        # sequence cut into segments, as many as fill ~2 waves of SMs while leaving each
        # segment at least 4 tiles (below that the reduce costs more than it saves).
        programs = num_seqs * num_kv_heads
        fill = -(-2 * sms // programs)
        segments = max(1, min(16, fill, max_seq_len // (4 * tile_n)))
        if segments > 1:
            reason += f"; split-KV into {segments} segments: decode-only batch has only {programs} programs"
        elif fill <= 1:
            reason += f"; no split: {programs} decode programs already fill the GPU"
        else:
            reason += f"; no split: contexts < {8 * tile_n} tokens are too short to split"
    else:
        reason += "; no split: batch has prefill rows"
    return AttentionConfig(block_q, 1, tile_n, 1, segments, 1, 4, 2), reason


def choose_cache_config(
    *,
    num_tokens: int,
    num_kv_heads: int,
    head_size: int,
    device: torch.device | str | None = None,
    target: str | None = None,
) -> tuple[CacheConfig, str]:
    """Pick the cache-write launch configuration; returns (config, reason)."""
    hd = next_pow2(num_kv_heads * head_size)
    if _target(device, target, 1)[0] == "interpreter":
        tokens = min(next_pow2(num_tokens), max(1, 16384 // hd))
        return CacheConfig(tokens, hd, 1), (
            f"interpreter: {tokens} tokens x all {num_kv_heads} heads per program (fixed cost per op)"
        )
    block_hd = min(hd, 1024)
    return CacheConfig(1, block_hd, 4), f"cuda: one token per program, {block_hd} (head, dim) elements per program"
