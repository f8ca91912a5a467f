"""Batch builders shared by the kernel tests (a uniquely named module: no clash with other suites)."""
from dataclasses import dataclass

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@dataclass
class Batch:
    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    scale: float

    def args(self):
        return (self.query, self.key_cache, self.value_cache, self.query_start_loc, self.seq_lens,
                self.block_tables, self.scale)


def make_batch(query_lens, seq_lens, *, q_heads, kv_heads, head_size, block_size, seed=0, dtype=torch.float32):
    """Random caches; each request gets shuffled, non-contiguous physical blocks.

    Block-table entries past a request's last block hold real block ids (not 0), so a kernel
    reading past seq_len would pick up wrong data instead of silently reading zeros.
    """
    g = torch.Generator().manual_seed(seed)
    assert all(s >= q for q, s in zip(query_lens, seq_lens))
    max_blocks = max(-(-s // block_size) for s in seq_lens) + 1
    num_blocks = len(seq_lens) * max_blocks + 3
    cache_shape = (num_blocks, block_size, kv_heads, head_size)
    key_cache = torch.randn(cache_shape, generator=g).to(dtype)
    value_cache = torch.randn(cache_shape, generator=g).to(dtype)
    block_tables = torch.randperm(num_blocks, generator=g)[: len(seq_lens) * max_blocks].view(len(seq_lens), max_blocks)
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    query = torch.randn(int(qsl[-1]), q_heads, head_size, generator=g).to(dtype)
    return Batch(
        query.to(DEVICE), key_cache.to(DEVICE), value_cache.to(DEVICE), qsl.to(DEVICE),
        torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), block_tables.int().to(DEVICE), head_size ** -0.5,
    )
