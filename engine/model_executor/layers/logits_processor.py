"""The LM head as a module (vLLM's ``model_executor/layers/logits_processor.py``
``LogitsProcessor``): hidden states times this rank's rows of the (vocab-parallel) LM-head
weight, then, with several ranks, every rank's slice of the logits all-gathered and the
vocabulary's padding cut off. A module so that profiling sees the LM head as one op."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed.parallel_state import TPGroup


class LogitsProcessor(nn.Module):
    def __init__(self, vocab_size: int, tp: TPGroup):
        super().__init__()
        self.vocab_size, self.tp = vocab_size, tp

    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Logits [rows, vocab_size], on every rank (weight: this rank's [vocab rows, hidden])."""
        logits = F.linear(x, weight)
        if self.tp.world_size == 1:
            return logits
        return self.tp.all_gather(logits, "lm_head")[:, :self.vocab_size]  # the padding's columns go
