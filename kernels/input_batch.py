"""Input-building kernels (Triton; vLLM 0.33's ``v1/worker/gpu/input_batch.py``): a step's
``input_ids``, ``positions`` and ``seq_lens`` gathered from the worker's persistent per-slot
buffers, and ``post_update`` writing the sampled tokens back into them.

Every kernel takes ``idx_mapping`` [num_reqs] (batch row -> request slot) and
``query_start_loc`` [num_reqs + 1] (row i owns tokens qsl[i]:qsl[i+1]); a request's tokens this
step sit at positions num_computed_tokens[slot], num_computed_tokens[slot] + 1, ... One program
handles one batch row and walks its tokens ``BLOCK`` at a time, so a decode row is one load and
one store per buffer. (vLLM launches the same grids with 1024-token blocks; the interpreter runs
the programs one after another at a fixed cost per operation, so its block is the longest query
of the step, rounded up to a power of two: one loop iteration per program.)

The slot's token buffer (``all_token_ids``) holds its prompt and every token the worker sampled
for it, so a decode row's input token is read there too; positions past the tokens it holds are
the drafts the step verifies (vLLM writes those two from ``last_sampled_tokens`` and the draft
buffer in ``_combine_sampled_and_draft_tokens_kernel``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import instrument
from kernels._env import INTERPRETED


def token_block(query_start_loc: torch.Tensor) -> tuple[int, str]:
    """Tokens a program handles per loop iteration, and why (the longest query is read only when
    interpreted: on a GPU it would cost a device sync)."""
    if INTERPRETED:
        longest = int((query_start_loc[1:] - query_start_loc[:-1]).max()) if query_start_loc.numel() > 1 else 1
        block = triton.next_power_of_2(max(1, longest))
        return block, f"interpreter: one program per request, its {block}-token block in one iteration"
    return 1024, "GPU: one program per request, 1024 tokens per iteration"


@triton.jit
def _prepare_prefill_inputs_kernel(
    input_ids_ptr, idx_mapping_ptr, query_start_loc_ptr, all_token_ids_ptr, all_token_ids_stride,
    prefill_len_ptr, num_computed_tokens_ptr, draft_tokens_ptr, draft_tokens_stride,
    BLOCK_SIZE: tl.constexpr,
):
    batch_idx = tl.program_id(0)
    req_state_idx = tl.load(idx_mapping_ptr + batch_idx).to(tl.int64)
    prefill_len = tl.load(prefill_len_ptr + req_state_idx)
    num_computed = tl.load(num_computed_tokens_ptr + req_state_idx)
    query_start = tl.load(query_start_loc_ptr + batch_idx)
    query_len = tl.load(query_start_loc_ptr + batch_idx + 1) - query_start
    request_ptr = all_token_ids_ptr + req_state_idx * all_token_ids_stride
    for i in range(0, query_len, BLOCK_SIZE):
        block = i + tl.arange(0, BLOCK_SIZE)
        pos = num_computed + block
        mask = block < query_len
        held = pos < prefill_len  # the slot's own tokens; after them, the drafts to verify
        tokens = tl.load(request_ptr + pos, mask=mask & held, other=0)
        drafts = tl.load(draft_tokens_ptr + batch_idx * draft_tokens_stride + pos - prefill_len,
                         mask=mask & ~held, other=0)
        tl.store(input_ids_ptr + query_start + block, tl.where(held, tokens, drafts), mask=mask)


def prepare_prefill_inputs(input_ids: torch.Tensor, idx_mapping: torch.Tensor, query_start_loc: torch.Tensor,
                           all_token_ids: torch.Tensor, prefill_len: torch.Tensor,
                           num_computed_tokens: torch.Tensor, draft_tokens: torch.Tensor) -> None:
    """Triton version of :func:`kernels.reference.prepare_prefill_inputs_ref` (same arguments):
    input_ids[qsl[i] + j] = the token at position num_computed_tokens[slot] + j of row i's slot
    (all_token_ids[slot], below prefill_len[slot]), else draft_tokens[i, position - prefill_len]."""
    num_reqs = idx_mapping.shape[0]
    if num_reqs == 0:
        return
    block, reason = token_block(query_start_loc)
    args = dict(input_ids_ptr=input_ids, idx_mapping_ptr=idx_mapping, query_start_loc_ptr=query_start_loc,
                all_token_ids_ptr=all_token_ids, all_token_ids_stride=all_token_ids.stride(0),
                prefill_len_ptr=prefill_len, num_computed_tokens_ptr=num_computed_tokens,
                draft_tokens_ptr=draft_tokens, draft_tokens_stride=draft_tokens.stride(0))
    instrument.launch("prepare_prefill_inputs", _prepare_prefill_inputs_kernel, (num_reqs,), args,
                      dict(BLOCK_SIZE=block), reason=reason)


@triton.jit
def _prepare_pos_seq_lens_kernel(
    pos_ptr, seq_lens_ptr, idx_mapping_ptr, query_start_loc_ptr, num_computed_tokens_ptr, max_num_reqs,
    BLOCK_SIZE: tl.constexpr,
):
    req_id = tl.program_id(0)
    num_reqs = tl.num_programs(0) - 1
    if req_id == num_reqs:  # the last program: seq_lens of the padding rows are 0
        for i in range(num_reqs, max_num_reqs, BLOCK_SIZE):
            block = i + tl.arange(0, BLOCK_SIZE)
            tl.store(seq_lens_ptr + block, 0, mask=block < max_num_reqs)
        return
    req_state_idx = tl.load(idx_mapping_ptr + req_id).to(tl.int64)
    num_computed = tl.load(num_computed_tokens_ptr + req_state_idx)
    start = tl.load(query_start_loc_ptr + req_id)
    query_len = tl.load(query_start_loc_ptr + req_id + 1) - start
    tl.store(seq_lens_ptr + req_id, num_computed + query_len)
    for i in range(0, query_len, BLOCK_SIZE):
        block = i + tl.arange(0, BLOCK_SIZE)
        tl.store(pos_ptr + start + block, num_computed + block, mask=block < query_len)


def prepare_pos_seq_lens(idx_mapping: torch.Tensor, query_start_loc: torch.Tensor, num_computed_tokens: torch.Tensor,
                         pos: torch.Tensor, seq_lens: torch.Tensor) -> None:
    """Triton version of :func:`kernels.reference.prepare_pos_seq_lens_ref` (same arguments):
    each token's position and each row's seq_len (tokens computed after this step); rows of
    seq_lens past num_reqs (padding) get 0, from one extra program."""
    num_reqs = idx_mapping.shape[0]
    block, reason = token_block(query_start_loc)
    args = dict(pos_ptr=pos, seq_lens_ptr=seq_lens, idx_mapping_ptr=idx_mapping, query_start_loc_ptr=query_start_loc,
                num_computed_tokens_ptr=num_computed_tokens, max_num_reqs=seq_lens.shape[0])
    instrument.launch("prepare_pos_seq_lens", _prepare_pos_seq_lens_kernel, (num_reqs + 1,), args,
                      dict(BLOCK_SIZE=block), reason=reason + "; one more program pads seq_lens with 0")


@triton.jit
def _post_update_kernel(
    idx_mapping_ptr, num_computed_tokens_ptr, sampled_tokens_ptr, sampled_tokens_stride, num_sampled_ptr,
    num_rejected_ptr, query_start_loc_ptr, all_token_ids_ptr, all_token_ids_stride, total_len_ptr,
    BLOCK_SIZE: tl.constexpr,
):
    req_id = tl.program_id(0)
    req_state_idx = tl.load(idx_mapping_ptr + req_id).to(tl.int64)
    if req_state_idx < 0:  # a padding row
        return
    total_len = tl.load(total_len_ptr + req_state_idx)
    num_sampled = tl.load(num_sampled_ptr + req_id)
    block = tl.arange(0, BLOCK_SIZE)
    tokens = tl.load(sampled_tokens_ptr + req_id * sampled_tokens_stride + block, mask=block < num_sampled)
    tl.store(all_token_ids_ptr + req_state_idx * all_token_ids_stride + total_len + block, tokens,
             mask=block < num_sampled)
    tl.store(total_len_ptr + req_state_idx, total_len + num_sampled)
    query_len = tl.load(query_start_loc_ptr + req_id + 1) - tl.load(query_start_loc_ptr + req_id)
    num_computed = tl.load(num_computed_tokens_ptr + req_state_idx)
    tl.store(num_computed_tokens_ptr + req_state_idx, num_computed + query_len - tl.load(num_rejected_ptr + req_id))


def post_update(idx_mapping: torch.Tensor, num_computed_tokens: torch.Tensor, sampled_tokens: torch.Tensor,
                num_sampled: torch.Tensor, num_rejected: torch.Tensor, query_start_loc: torch.Tensor,
                all_token_ids: torch.Tensor, total_len: torch.Tensor) -> None:
    """Triton version of :func:`kernels.reference.post_update_ref` (same arguments): row i's
    first num_sampled[i] tokens of sampled_tokens[i] appended to its slot's buffer (total_len
    grows by as many), and num_computed_tokens advanced by its query length less its rejected
    drafts. The buffer's rows must already be wide enough."""
    num_reqs = idx_mapping.shape[0]
    if num_reqs == 0:
        return
    block = triton.next_power_of_2(max(1, sampled_tokens.shape[1]))
    args = dict(idx_mapping_ptr=idx_mapping, num_computed_tokens_ptr=num_computed_tokens,
                sampled_tokens_ptr=sampled_tokens, sampled_tokens_stride=sampled_tokens.stride(0),
                num_sampled_ptr=num_sampled, num_rejected_ptr=num_rejected, query_start_loc_ptr=query_start_loc,
                all_token_ids_ptr=all_token_ids, all_token_ids_stride=all_token_ids.stride(0), total_len_ptr=total_len)
    instrument.launch("post_update", _post_update_kernel, (num_reqs,), args, dict(BLOCK_SIZE=block),
                      reason=f"one program per request: up to {block} sampled token(s) in one store")
