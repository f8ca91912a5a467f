"""One step's flattened inputs (vLLM 0.33's ``v1/worker/gpu/input_batch.py``), built from the
persistent request state by slot.

``idx_mapping`` maps each batch row to its request's slot; everything else is gathered through
it: the input token ids (prompt or recomputed tokens from the slot's token buffer, then any
drafts to verify), positions and seq_lens from where its computed tokens end, its block table row,
and each token's slot in the paged KV cache.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.core.sched.output import SchedulerOutput
from engine.worker.block_table import BlockTables
from engine.worker.states import RequestState


@dataclass
class InputBatch:
    req_ids: list[str]  # batch order
    idx_mapping: np.ndarray  # [num_reqs] batch row -> request slot
    num_scheduled_tokens: np.ndarray  # [num_reqs]
    query_start_loc: np.ndarray  # [num_reqs + 1] int32
    seq_lens: np.ndarray  # [num_reqs] int32: computed tokens after this step
    input_ids: np.ndarray  # [num_tokens] int64
    positions: np.ndarray  # [num_tokens] int64
    slot_mapping: np.ndarray  # [num_tokens] int64
    block_tables: np.ndarray  # [num_reqs, max blocks] int32, padded with the null block (0)
    logits_indices: np.ndarray  # the rows projected to logits: each request's last, or every draft's and its last
    draft_token_ids: list[list[int]]  # per request, the drafts it verifies


def resolve_placeholder_drafts(spec: dict[str, list[int]], last_drafts: dict[str, list[int]]) -> dict:
    """Async scheduling: a request's placeholder draft ids (-1) become the drafts proposed after the
    previous step, as many as it has (the rest stay -1: not verified)."""
    if not any(d and d[0] < 0 for d in spec.values()):
        return spec
    return {rid: (last_drafts.get(rid, []) + d)[:len(d)] if d and d[0] < 0 else d for rid, d in spec.items()}


def make_input_batch(sched: SchedulerOutput, states: RequestState, tables: BlockTables,
                     block_size: int, last_drafts: dict[str, list[int]] | None = None) -> InputBatch:
    req_ids = list(sched.num_scheduled_tokens)
    idx = np.fromiter(map(states.req_id_to_index.__getitem__, req_ids), np.int64, len(req_ids))
    num_sched = np.fromiter(sched.num_scheduled_tokens.values(), np.int32, len(req_ids))
    spec = resolve_placeholder_drafts(sched.scheduled_spec_decode_tokens, last_drafts or {})
    drafts = [[t for t in spec.get(rid, []) if t >= 0] for rid in req_ids]
    if spec:  # placeholder drafts left unresolved are not computed (the scheduler counts them rejected)
        num_sched -= np.fromiter((len(spec.get(rid, [])) - len(d) for rid, d in zip(req_ids, drafts)), np.int32,
                                 len(req_ids))
    qsl = np.zeros(len(req_ids) + 1, np.int32)
    np.cumsum(num_sched, out=qsl[1:])
    start = states.num_computed_tokens[idx]
    seq_lens = (start + num_sched).astype(np.int32)
    rows = np.repeat(np.arange(len(req_ids)), num_sched)
    positions = (np.arange(qsl[-1]) - qsl[rows] + start[rows]).astype(np.int64)
    # tokens the slot holds; draft positions (past them) are filled below
    input_ids = states.token_ids[idx[rows], np.minimum(positions, states.token_ids.shape[1] - 1)]
    for i, d in enumerate(drafts):
        if d:
            input_ids[qsl[i + 1] - len(d):qsl[i + 1]] = d
    width = int(tables.num_blocks[idx].max())
    block_tables = tables.block_tables[idx, :width]
    slot_mapping = block_tables[rows, positions // block_size].astype(np.int64) * block_size + positions % block_size
    if any(drafts):  # every draft's row is scored, not only the last
        logits_indices = np.concatenate([np.arange(qsl[i + 1] - 1 - len(d), qsl[i + 1]) for i, d in enumerate(drafts)])
    else:
        logits_indices = qsl[1:].astype(np.int64) - 1
    return InputBatch(req_ids, idx, num_sched, qsl, seq_lens, input_ids, positions, slot_mapping,
                      np.ascontiguousarray(block_tables), logits_indices.astype(np.int64), drafts)
