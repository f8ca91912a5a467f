"""Sort a batch's (token, expert) pairs into expert-contiguous blocks (vLLM's
``layers/fused_moe/moe_align_block_size.py``, whose CUDA op this is in PyTorch).

Example (vLLM's): topk_ids = [[2, 3, 0], [1, 2, 0], [1, 3, 0], [1, 2, 3]], block_size 4,
4 experts. The 12 pairs, flattened, are ids 0..11; expert 0 has pairs 2, 5, 8; expert 1 has
3, 6, 9; expert 2 has 0, 4, 10; expert 3 has 1, 7, 11. Each run is padded with 12 to 4 rows:
sorted_token_ids = [2 5 8 12 | 3 6 9 12 | 0 4 10 12 | 1 7 11 12], expert_ids = [0 1 2 3],
num_tokens_post_padded = 16. A grouped GEMM then gives each block of 4 rows to one program,
which reads one expert's weights; the padding rows are masked off.
"""
from __future__ import annotations

import torch


def moe_align_block_size(topk_ids: torch.Tensor, block_size: int, num_experts: int,
                         expert_map: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_token_ids, expert_ids, num_tokens_post_padded), vLLM's semantics (see the module
    docstring). topk_ids [T, top_k]; sorted_token_ids [T·top_k + E·(block_size−1)] of flat
    (token·top_k + k) ids, expert-contiguous, each expert's run padded with T·top_k to a
    multiple of block_size; expert_ids [len / block_size] the expert of each block (blocks past
    num_tokens_post_padded are never read); num_tokens_post_padded [1]. No host sync.
    expert_map [num_experts] (expert parallelism): global expert -> this rank's index, -1 for
    another rank's; every pair is aligned, then the blocks of other ranks' experts are marked
    -1 (the kernel writes zeros for them), as vLLM does."""
    flat = topk_ids.flatten().long()
    n, dev = flat.numel(), flat.device
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_size - 1) // block_size * block_size
    ends = padded.cumsum(0)
    max_rows = n + num_experts * (block_size - 1)
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert, in token order within each
    by_expert = flat[order]
    rank = torch.arange(n, device=dev) - (counts.cumsum(0) - counts)[by_expert]
    sorted_ids = torch.full((max_rows,), n, dtype=torch.int32, device=dev)
    sorted_ids[(ends - padded)[by_expert] + rank] = order.to(torch.int32)
    block_starts = torch.arange(0, max_rows, block_size, device=dev)
    expert_ids = torch.searchsorted(ends, block_starts, right=True).clamp_(max=num_experts - 1).to(torch.int32)
    if expert_map is not None:
        expert_ids = expert_map[expert_ids.long()].to(torch.int32)
    return sorted_ids, expert_ids, ends[-1:].to(torch.int32)
