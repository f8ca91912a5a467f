"""The token embedding split by vocabulary over the tensor-parallel ranks (vLLM's
``model_executor/layers/vocab_parallel_embedding.py``: ``VocabParallelEmbedding``,
``pad_vocab_size``), also used, tied, as the LM head.

With N > 1 ranks the vocabulary is padded to a multiple of 64 (vLLM's
``DEFAULT_VOCAB_PADDING_SIZE``; GPT-2's 50,257 rows become 50,304) and cut into N equal
shards; the padding rows are zeros. A lookup on rank r finds only the ids in its shard: the
others are masked to row 0 and their vectors zeroed, so summing the ranks' results (one
all-reduce) gives every rank each token's full vector. As the tied LM head, rank r's shard
gives the logits of its slice of the vocabulary; the model all-gathers them and cuts off the
padding's columns.

With one rank nothing is split, and nothing is padded: the table is the checkpoint's own
(vLLM pads it to 64 rows even then; here the padding would only cost a little LM-head time).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed.parallel_state import TPGroup

DEFAULT_VOCAB_PADDING_SIZE = 64


def pad_vocab_size(vocab_size: int, world_size: int, pad_to: int = DEFAULT_VOCAB_PADDING_SIZE) -> int:
    """The vocabulary rounded up to a multiple of pad_to that also splits evenly over world_size
    (vLLM asserts the second; a multiple of 64 splits evenly over 2, 4 or 8 ranks anyway)."""
    if world_size == 1:
        return vocab_size
    step = math.lcm(pad_to, world_size)
    return -(-vocab_size // step) * step


class VocabParallelEmbedding(nn.Module):
    """``weight`` holds this rank's rows [shard_range) of the padded vocabulary (see the module
    docstring); forward(ids) -> [len(ids), dim] on every rank, after one all-reduce."""

    def __init__(self, vocab_size: int, dim: int, tp: TPGroup, site: str = "wte"):
        super().__init__()
        self.tp, self.site = tp, site
        self.org_vocab_size = vocab_size
        self.num_embeddings_padded = pad_vocab_size(vocab_size, tp.world_size)
        per_rank = self.num_embeddings_padded // tp.world_size
        self.shard_range = (tp.rank * per_rank, (tp.rank + 1) * per_rank)
        self.weight = nn.Parameter(torch.empty(per_rank, dim))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return F.embedding(input_ids, self.weight)
        start, end = self.shard_range
        elsewhere = (input_ids < start) | (input_ids >= end)  # ids another rank holds
        local = (input_ids - start).masked_fill_(elsewhere, 0)
        x = F.embedding(local, self.weight).masked_fill_(elsewhere.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(x, self.site)

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a full [vocab_size, dim] checkpoint table, zero rows for padding."""
        if self.tp.world_size == 1:
            return full
        start, end = self.shard_range
        rows = full[start:min(end, self.org_vocab_size)]
        return F.pad(rows, (0, 0, 0, (end - start) - rows.shape[0]))
