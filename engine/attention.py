"""Attention metadata and backends.

The model runner builds one ``AttentionMetadata`` per step and passes it explicitly to the
model (no hidden globals). A backend is two functions with the kernels' signatures: write the
step's K/V into the paged cache, then attend. ``torch`` uses the PyTorch references,
``triton`` our Triton kernels (see kernels/).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] where each new token's K/V is written
    query_start_loc: torch.Tensor  # [num_seqs + 1] cu_seqlens_q
    seq_lens: torch.Tensor  # [num_seqs] context + new tokens
    block_tables: torch.Tensor  # [num_seqs, max_blocks]
    max_query_len: int
    max_seq_len: int


class AttentionBackend:
    name: str

    def __init__(self, name: str):
        self.name = name
        if name == "torch":
            from kernels.reference import reshape_and_cache_ref, unified_attention_ref
            self._write, self._attend = reshape_and_cache_ref, unified_attention_ref
        elif name == "triton":
            import kernels
            self._write, self._attend = kernels.reshape_and_cache, kernels.unified_attention
        else:
            raise ValueError(f"attention_backend must be 'torch' or 'triton', got {name!r}")

    def forward(self, q, k, v, key_cache, value_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        self._write(k, v, key_cache, value_cache, meta.slot_mapping)
        if self.name == "triton":
            return self._attend(q, key_cache, value_cache, meta.query_start_loc, meta.seq_lens,
                                meta.block_tables, scale, max_query_len=meta.max_query_len,
                                max_seq_len=meta.max_seq_len)
        return self._attend(q, key_cache, value_cache, meta.query_start_loc, meta.seq_lens,
                            meta.block_tables, scale)


def default_backend(device: torch.device) -> str:
    # On the CPU Triton runs through its interpreter, which is far slower than PyTorch, so the
    # engine defaults to the PyTorch backend there (measured: see README, kernels benchmark).
    return "triton" if device.type == "cuda" else "torch"
