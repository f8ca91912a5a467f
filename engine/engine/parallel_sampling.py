"""n > 1: one request fans out into n children (vLLM V1's ``v1/engine/parallel_sampling.py``).

Each child is an ordinary request to the engine core, id ``f"{index}_{parent id}"``, with n=1 and,
for a seeded request, seed + index, so a seeded request is reproducible and its children differ.
Their prompts are the same tokens, so with prefix caching the children's block tables share the
prompt's full blocks (reference counts > 1); each writes its own blocks from where they diverge.
The OutputProcessor gathers the children's outputs into one RequestOutput with n completions.
"""
from __future__ import annotations

from dataclasses import replace

import msgspec

from engine.engine.core_types import EngineCoreRequest
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams


class ParentRequest:
    """The children's ids and params, and their latest completions (index = child index)."""

    def __init__(self, request_id: str, params: SamplingParams):
        self.request_id, self.params = request_id, params
        self.child_ids = [f"{i}_{request_id}" for i in range(params.n)]
        self.index = {cid: i for i, cid in enumerate(self.child_ids)}
        self.completions: list[CompletionOutput | None] = [None] * params.n
        self.num_finished = 0

    def child_params(self, index: int) -> SamplingParams:
        seed = None if self.params.seed is None else self.params.seed + index
        return replace(self.params, n=1, seed=seed)

    def add_output(self, child: RequestOutput) -> RequestOutput | None:
        """Take a child's output; the parent's output to hand out, or None (final_only: not all done)."""
        i = self.index[child.request_id]
        completion = replace(child.outputs[0], index=i)
        if completion.finish_reason is not None and (self.completions[i] is None or
                                                     self.completions[i].finish_reason is None):
            self.num_finished += 1
        self.completions[i] = completion
        finished = self.num_finished == len(self.child_ids)
        if self.params.output_kind == "final_only" and not finished:
            return None
        done = [c for c in self.completions if c is not None]
        return replace(child, request_id=self.request_id, outputs=done, finished=finished)


def fan_out(request: EngineCoreRequest) -> tuple[ParentRequest | None, list[EngineCoreRequest]]:
    """The requests to send the core for one request: itself (n = 1), or its n children."""
    params = request.sampling_params
    if params.n == 1:
        return None, [request]
    parent = ParentRequest(request.request_id, params)
    return parent, [msgspec.structs.replace(request, request_id=cid, sampling_params=parent.child_params(i))
                    for i, cid in enumerate(parent.child_ids)]
