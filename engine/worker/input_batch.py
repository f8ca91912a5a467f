"""One step's flattened inputs (vLLM 0.33's ``v1/worker/gpu/input_batch.py``), built from the
persistent request state by slot, by the input-building kernels (kernels/input_batch.py,
kernels/block_table.py).

``idx_mapping`` maps each batch row to its request's slot; everything else is gathered through
it, one launch per array: ``prepare_prefill_inputs`` the input token ids (prompt or recomputed
tokens from the slot's token buffer, then any drafts to verify), ``prepare_pos_seq_lens`` the
positions and seq_lens from where its computed tokens end, ``gather_block_tables`` its block
table row, ``compute_slot_mappings`` each token's slot in the paged KV cache (these two once per
KV-cache group: a hybrid model's groups have their own tables). With the triton
backend these are our Triton kernels; otherwise their PyTorch references (vectorised: a few
tensor ops per launch whatever the batch), each a launch the Kernels panel lists.

The per-slot buffers are numpy arrays on the host: on the CPU the kernels read them in place
(``InputBuffers``: torch views sharing their memory); on a GPU they are copied to it each step, and
what ``post_update`` writes there after sampling is copied back.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

import kernels
from engine.core.sched.output import SchedulerOutput
from engine.worker.block_table import BlockTables
from engine.worker.states import RequestState
from kernels import instrument

#: The input-building launches, in the order a step makes them (post_update runs after sampling).
INPUT_KERNELS = ("prepare_prefill_inputs", "prepare_pos_seq_lens", "gather_block_tables", "compute_slot_mappings",
                 "post_update")


class InputKernels:
    """The input-building launches of one worker: each attribute (named as in INPUT_KERNELS) is
    the Triton kernel with the triton backend, else its PyTorch reference launched through
    ``instrument.call`` (named ``<kernel>_ref``); both take the kernel's keyword arguments and
    write their outputs in place. (An attribute can be replaced: exercise 1 puts the learner's
    slot mapping in place of the reference's.)"""

    def __init__(self, backend: str):
        self.backend = backend
        for name in INPUT_KERNELS:
            setattr(self, name, getattr(kernels, name) if backend == "triton" else _reference(name))


def _reference(name: str):
    fn = getattr(kernels, f"{name}_ref")

    def launch(**args) -> None:
        instrument.call(f"{name}_ref", fn, args, reason="attention_backend=torch: PyTorch reference")

    launch.__name__ = f"{name}_ref"
    return launch


class InputBuffers:
    """The persistent buffers as the kernels read them: on the CPU torch views of the numpy arrays
    (the same memory), made again only when an array is replaced (it grew); on a GPU a copy each
    step."""

    def __init__(self, device: torch.device):
        self.device = device
        self._views: dict[str, tuple[np.ndarray, torch.Tensor]] = {}

    def __call__(self, name: str, array: np.ndarray) -> torch.Tensor:
        if self.device.type != "cpu":
            return torch.from_numpy(array).to(self.device)
        view = self._views.get(name)
        if view is None or view[0] is not array:
            view = self._views[name] = (array, torch.from_numpy(array))
        return view[1]

    def write_back(self, array: np.ndarray, tensor: torch.Tensor) -> None:
        """A kernel wrote tensor in place: on a GPU (a copy) its values go back to the host array."""
        if self.device.type != "cpu":
            array[...] = tensor.cpu().numpy()


@dataclass
class InputBatch:
    req_ids: list[str]  # batch order
    idx_mapping: torch.Tensor  # [num_reqs] batch row -> request slot
    idx_mapping_np: np.ndarray
    num_scheduled_tokens: np.ndarray  # [num_reqs] int32
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    query_start_loc_np: np.ndarray
    seq_lens: torch.Tensor  # [num_reqs] int32: computed tokens after this step
    seq_lens_np: np.ndarray
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    slot_mapping: torch.Tensor  # [num_tokens] int64
    block_tables: torch.Tensor  # [num_reqs, max blocks] int32, padded with the null block (0)
    logits_indices: np.ndarray  # the rows projected to logits: each request's last, or every draft's and its last
    draft_token_ids: list[list[int]]  # per request, the drafts it verifies
    # per KV-cache group (the first: block_tables, slot_mapping; more for a hybrid model)
    block_tables_by_group: list[torch.Tensor] | None = None
    slot_mappings_by_group: list[torch.Tensor] | None = None


def resolve_placeholder_drafts(spec: dict[str, list[int]], last_drafts: dict[str, list[int]]) -> dict:
    """Async scheduling: a request's placeholder draft ids (-1) become the drafts proposed after the
    previous step, position by position, as many as it has (the rest stay -1: not verified). A draft
    already in place is one of those same drafts (the executor's, or the engine core's once it learned
    them: update_draft_token_ids_in_output, possibly while this step runs), so the worker verifies its
    own drafts whatever it finds there."""
    if not any(-1 in d for d in spec.values()):
        return spec
    return {rid: [t if t >= 0 else o for t, o in zip(d, last_drafts.get(rid, []) + [-1] * len(d))] if -1 in d else d
            for rid, d in spec.items()}


def make_input_batch(sched: SchedulerOutput, states: RequestState, tables: BlockTables, block_size: int,
                     launch: InputKernels, buffers: InputBuffers,
                     last_drafts: dict[str, list[int]] | None = None) -> InputBatch:
    req_ids = list(sched.num_scheduled_tokens)
    num_reqs = len(req_ids)
    idx = np.fromiter(map(states.req_id_to_index.__getitem__, req_ids), np.int64, num_reqs)
    num_sched = np.fromiter(sched.num_scheduled_tokens.values(), np.int32, num_reqs)
    spec = resolve_placeholder_drafts(sched.scheduled_spec_decode_tokens, last_drafts or {})
    drafts = [[t for t in spec.get(rid, []) if t >= 0] for rid in req_ids]
    if spec:  # placeholder drafts left unresolved are not computed (the scheduler counts them rejected)
        num_sched -= np.fromiter((len(spec.get(rid, [])) - len(d) for rid, d in zip(req_ids, drafts)), np.int32,
                                 num_reqs)
    qsl = np.zeros(num_reqs + 1, np.int32)
    np.cumsum(num_sched, out=qsl[1:])
    num_tokens = int(qsl[-1])
    draft_tokens = np.zeros((num_reqs, max(1, max(map(len, drafts), default=0))), np.int64)
    if spec:
        for i, d in enumerate(drafts):
            draft_tokens[i, :len(d)] = d
    device = buffers.device
    tensor = torch.from_numpy if device.type == "cpu" else lambda a: torch.from_numpy(a).to(device)
    idx_t, qsl_t = tensor(idx), tensor(qsl)
    input_ids = torch.empty(num_tokens, dtype=torch.int64, device=device)
    positions = torch.empty(num_tokens, dtype=torch.int64, device=device)
    seq_lens = torch.empty(num_reqs, dtype=torch.int32, device=device)
    slot_mapping = torch.empty(num_tokens, dtype=torch.int64, device=device)
    block_tables = torch.empty(num_reqs, int(tables.num_blocks[idx].max()), dtype=torch.int32, device=device)
    num_computed = buffers("num_computed_tokens", states.num_computed_tokens)
    launch.prepare_prefill_inputs(input_ids=input_ids, idx_mapping=idx_t, query_start_loc=qsl_t,
                                  all_token_ids=buffers("token_ids", states.token_ids),
                                  prefill_len=buffers("num_tokens", states.num_tokens),
                                  num_computed_tokens=num_computed, draft_tokens=tensor(draft_tokens))
    launch.prepare_pos_seq_lens(idx_mapping=idx_t, query_start_loc=qsl_t, num_computed_tokens=num_computed,
                                pos=positions, seq_lens=seq_lens)
    tables_by_group, slots_by_group = [block_tables], [slot_mapping]
    for g in range(tables.num_kv_cache_groups):  # each KV-cache group has its own tables (a hybrid model)
        if g:
            tables_by_group.append(torch.empty(num_reqs, int(tables.group_num_blocks[g][idx].max()),
                                               dtype=torch.int32, device=device))
            slots_by_group.append(torch.empty(num_tokens, dtype=torch.int64, device=device))
        name = f"block_tables{g or ''}"
        slot_tables = buffers(name, tables.group_block_tables[g])
        launch.gather_block_tables(idx_mapping=idx_t, block_tables=slot_tables,
                                   num_blocks=buffers(f"num_blocks{g or ''}", tables.group_num_blocks[g]),
                                   out=tables_by_group[g])
        launch.compute_slot_mappings(idx_mapping=idx_t, query_start_loc=qsl_t, positions=positions,
                                     block_tables=slot_tables, block_size=block_size, slot_mapping=slots_by_group[g])
    if any(drafts):  # every draft's row is scored, not only the last
        logits_indices = np.concatenate([np.arange(qsl[i + 1] - 1 - len(d), qsl[i + 1]) for i, d in enumerate(drafts)])
    else:
        logits_indices = qsl[1:].astype(np.int64) - 1
    return InputBatch(req_ids, idx_t, idx, num_sched, qsl_t, qsl, seq_lens, states.num_computed_tokens[idx] + num_sched,
                      input_ids, positions, slot_mapping, block_tables, logits_indices.astype(np.int64), drafts,
                      tables_by_group, slots_by_group)
