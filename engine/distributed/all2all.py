"""Expert parallelism's token exchange (vLLM's ``device_communicators/all2all.py``,
``AgRsAll2AllManager``: the ``allgather_reducescatter`` backend, vLLM's default).

With ``enable_expert_parallel`` each of the N ranks holds E/N whole experts instead of 1/N of
every expert. A token routed to an expert of another rank must get there and back:

* ``dispatch``: each rank contributes its share of the tokens (rows [r·T/N, (r+1)·T/N), the
  batch padded to a multiple of N) and an all-gather gives every rank every token;
* each rank runs its own experts on every token (the pairs routed elsewhere add nothing);
* ``combine``: a reduce-scatter sums the ranks' partial outputs, each rank receiving the sum
  for its own share of the tokens; the attention that follows is tensor-parallel and needs
  every token on every rank, so an all-gather hands the shares back to everyone.

Under tensor parallelism alone every rank already holds every token (the row-parallel
o_proj's all-reduce gave them), so the dispatch gathers what each rank has: it is kept
because it is the exchange vLLM makes between data-parallel ranks, whose tokens differ, and
its bytes are what expert parallelism costs there. All three collectives are traced as
launches (``all_gather``, ``reduce_scatter``) with the bytes each rank sends.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.distributed.parallel_state import TPGroup
from engine.trace_names import ALL_GATHER, REDUCE_SCATTER
from kernels import instrument


class AgRsAll2AllManager:
    def __init__(self, tp: TPGroup, site: str):
        self.tp, self.site = tp, site

    def dispatch(self, x: torch.Tensor) -> torch.Tensor:
        """[T, H] on every rank -> [T', H] (T' = T rounded up to N): every rank's share, gathered."""
        n = self.tp.world_size
        share = -(-x.shape[0] // n)
        x = F.pad(x, (0, 0, 0, share * n - x.shape[0]))
        mine = x[self.tp.rank * share:(self.tp.rank + 1) * share]
        return self._call(ALL_GATHER, self._all_gather, mine, f"{self.site} dispatch: each rank's tokens, to every "
                                                              "rank (expert parallelism)")

    def combine(self, out: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """[T', H] partial outputs (this rank's experts) -> [num_tokens, H], the sum over ranks."""
        mine = self._call(REDUCE_SCATTER, self._reduce_scatter, out, f"{self.site} combine: the experts' outputs "
                                                                     "summed, each rank its share of the tokens")
        every = self._call(ALL_GATHER, self._all_gather, mine, f"{self.site} combine: the shares back to every rank "
                                                               "(the attention that follows is tensor-parallel)")
        return every[:num_tokens]

    def _call(self, name: str, fn, x: torch.Tensor, reason: str) -> torch.Tensor:
        meta = dict(op=name, world_size=self.tp.world_size, bytes=x.numel() * x.element_size(), site=self.site,
                    group=self.tp.active)
        return instrument.call(name, fn, dict(tensor=x), meta=meta, reason=reason)

    def _all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist
        out = tensor.new_empty(tensor.shape[0] * self.tp.world_size, *tensor.shape[1:])
        dist.all_gather_single(out, tensor.contiguous(), group=self.tp.groups[self.tp.active])
        return out

    def _reduce_scatter(self, tensor: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist
        out = tensor.new_empty(tensor.shape[0] // self.tp.world_size, *tensor.shape[1:])
        dist.reduce_scatter_single(out, tensor.contiguous(), group=self.tp.groups[self.tp.active])
        return out
