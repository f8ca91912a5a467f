"""The model runner (vLLM 0.33's Model Runner V2, ``v1/worker/gpu/model_runner.py``): the
scheduler's diff in, one flattened batch, one forward pass, sampled tokens out.

It keeps every live request by slot (``RequestState``, ``BlockTables``: engine/worker/states.py,
block_table.py), filled from each ``SchedulerOutput`` by finish_requests, add_requests and
update_requests: the requests' tokens (post_update appends what it samples), where their computed tokens
end, their block tables and sampling settings. ``execute_model`` builds the step's ``InputBatch``
from those buffers by slot and runs the forward pass; ``sample_tokens(grammar_output)`` applies the
grammar bitmask, samples (verifying drafts), writes the new tokens into the slots' buffers (the
``post_update`` launch, after the sampler's) and returns the ``ModelRunnerOutput``; a proposer then
drafts for the next step (``take_draft_token_ids``).

All scheduled tokens of all requests are concatenated (no padding). For each token we know its
position and its slot in the paged cache (slot = physical block * block_size + offset, looked up
in the request's block table). Only each request's last position is projected to logits. The
positions feed GPT-2's learned position table or, for a RoPE model (Llama, Qwen3), the rotation
of q and k; the batch event then says so (``rope``), and each layer's ``rotary_embedding`` launch
precedes its cache write.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

import kernels
from engine.core.kv_cache_interface import group_of_layer
from engine.core.kv_cache_utils import kv_cache_groups_of
from engine.core.sched.output import GrammarOutput, SchedulerOutput
from engine.hooks import INSTANT, Hooks
from engine.model_executor.layers.attention import AttentionMetadata
from engine.model_executor.layers.fused_moe.layer import moe_layers
from engine.outputs import DraftTokenIds, KVConnectorOutput, ModelRunnerOutput
from engine.sample.rejection_sampler import RejectionSampler, requests_after_drafts, spec_logprobs
from engine.sample.sampler import Sampler
from engine.spec_decode.ngram_proposer import NgramProposer
from engine.trace_names import BATCH, DRAFT_PREFIX, KERNEL, MODEL_RUNNER, ROUTING, is_attention_kernel
from engine.worker.block_table import BlockTables
from engine.worker.input_batch import InputBatch, InputBuffers, InputKernels, make_input_batch
from engine.worker.profiler import Profiler
from engine.worker.states import RequestState
from kernels import instrument
from kernels.op_cost import ATTENTION, launch_cost


@dataclass
class ModelInput:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # last scheduled position of each request
    all_last: bool = False  # every row is some request's last (all decodes): no rows to pick


@dataclass
class _Pending:
    """A step between execute_model and sample_tokens: its batch and logits."""
    sched: SchedulerOutput
    batch: InputBatch
    inp: ModelInput
    requests: list  # their CachedRequestStates, in batch order
    logits: torch.Tensor
    prompt_logits: torch.Tensor | None
    spans: list[tuple[int, int, int]]
    expert_load: dict[int, list[int]] | None = None  # a mixture of experts: tokens per expert, per MoE layer


class ModelRunner:
    """Runs the scheduled batch through the model (see the module docstring). execute_model(sched)
    returns None; sample_tokens(grammar_output) the step's ModelRunnerOutput."""

    def __init__(self, model: nn.Module, kv_caches, block_size: int, device: torch.device, hooks: Hooks | None = None,
                 rank: int = 0, profiler_dir: str | None = None, max_num_reqs: int = 64, max_model_len: int = 2048):
        self.model = model
        self.rank = rank  # tensor-parallel rank: in every kernel event and sampler/sampled
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.max_model_len = max_model_len
        self.req_states = RequestState(max_num_reqs, max_model_len)
        # the model's KV-cache groups: one block table each (a hybrid model's sliding-window and full layers)
        groups = kv_cache_groups_of(model.cfg, block_size) if hasattr(model, "cfg") else []
        self.sliding_windows = [g.kv_cache_spec.sliding_window for g in groups] or [None]
        self.layer_group = group_of_layer(groups) if len(groups) > 1 else {}
        self.block_tables = BlockTables(max_num_reqs, -(-max_model_len // block_size), len(self.sliding_windows))
        self.input_kernels = InputKernels(model.backend.name)  # what builds each step's inputs from those
        self.input_buffers = InputBuffers(device)  # those buffers as the kernels read them
        self.sampler = Sampler(model.backend.name)  # every live request's sampling settings, by slot
        self.rejection_sampler: RejectionSampler | None = None  # made on the first step with draft tokens
        self.drafter = None  # a DraftModelProposer (set by the Worker) or an NgramProposer: runs after sampling
        self.rope = getattr(model, "rope", None)  # what the positions rotate by (None: a learned position table)
        self.moe_layers = moe_layers(model)  # (layer index, FusedMoE) of a mixture of experts' sparse layers
        self.hooks = hooks or Hooks()
        # numpy array -> tensor on the model's device (no copy on the CPU)
        self._tensor = torch.from_numpy if device.type == "cpu" else lambda a: torch.from_numpy(a).to(device)
        self._launches: list[instrument.LaunchRecord] = []  # this step's, not yet published
        self._held: tuple[str, dict] | None = None  # (name, arguments) of the launch a gate holds before
        self.profiler = Profiler(model, rank, profiler_dir)  # every op a launch, on demand (profile())
        self._profiled_lens: tuple[list[int], list[int]] | None = None  # a profiled step's query and sequence lengths
        self._costs: dict[tuple, tuple[str, int, int]] = {}  # (launch name, its arguments) -> (op, FLOPs, bytes)
        self._pending: _Pending | None = None  # between execute_model and sample_tokens
        self._draft_token_ids: DraftTokenIds | None = None  # the last step's proposals, until taken
        self.last_draft_token_ids: dict[str, list[int]] = {}  # ... kept: they fill placeholder drafts
        self.kv_connector = None  # a KV connector's worker side (set by the Worker), or None
        self._kv_connector_output = None  # its finished transfers, for the step's ModelRunnerOutput

    # ---- the persistent state (Model Runner V2's add_requests / update_requests / finish_requests) ----
    def finish_requests(self, scheduler_output: SchedulerOutput) -> None:
        """Free the slots of the requests that finished since the last step, and of those preempted (as
        V1's: a preempted request comes back whole, as a NewRequestData)."""
        done = scheduler_output.finished_req_ids | scheduler_output.preempted_req_ids
        for rid in sorted(done):  # sorted: every rank frees its slots in the same order
            self.req_states.remove_request(rid)
        self.sampler.finish_requests(done)  # their sampling slots are free again

    def add_requests(self, scheduler_output: SchedulerOutput) -> None:
        """Each NewRequestData takes a slot: its tokens, block table and sampling settings."""
        for new in scheduler_output.scheduled_new_reqs:
            self.req_states.remove_request(new.req_id)  # (sent again whole: nothing of the old state is kept)
            slot = self.req_states.add_request(new.req_id, len(new.prompt_token_ids), new.prefill_token_ids,
                                               new.num_computed_tokens, new.sampling_params, new.eos_token_id,
                                               new.seed)
            self.block_tables.append_block_ids(slot, new.block_ids, overwrite=True)
            self.sampler.finish_requests((new.req_id,))  # its settings and seed as sent now, not an old request's
            self.sampler.states.add_request(new.req_id, new.sampling_params, new.seed, new.eos_token_id)

    def update_requests(self, scheduler_output: SchedulerOutput) -> None:
        """CachedRequestData: where each request's tokens start, its new blocks (a resumed one's whole table)."""
        c, states = scheduler_output.scheduled_cached_reqs, self.req_states
        for rid, blocks, computed in zip(c.req_ids, c.new_block_ids, c.num_computed_tokens):
            slot = states.req_id_to_index[rid]
            # async scheduling: the scheduler counted the drafts of the step before as accepted; all but
            # this worker's last sampled token are computed
            states.num_computed_tokens[slot] = min(computed, states.num_tokens[slot] - 1)
            if blocks is not None or rid in c.resumed_req_ids:
                self.block_tables.append_block_ids(slot, blocks, overwrite=rid in c.resumed_req_ids)

    def prepare_inputs(self, scheduler_output: SchedulerOutput) -> InputBatch:
        """The step's InputBatch, gathered from the persistent buffers by slot (by the input kernels:
        launches of the step, traced with its forward pass's)."""
        batch = make_input_batch(scheduler_output, self.req_states, self.block_tables, self.block_size,
                                 self.input_kernels, self.input_buffers, self.last_draft_token_ids)
        if self.hooks.active and self.rank == 0:  # the same on every rank: traced once
            self._trace_batch(scheduler_output.step, batch)
        return batch

    def _trace_batch(self, step: int, batch: InputBatch) -> None:
        self.hooks.emit(MODEL_RUNNER, BATCH, step=step, input_ids=batch.input_ids.tolist(),
                        positions=batch.positions.tolist(), slot_mapping=batch.slot_mapping.tolist(),
                        seq_lens=batch.seq_lens_np.tolist(), query_start_loc=batch.query_start_loc_np.tolist(),
                        block_tables=batch.block_tables.tolist(), request_ids=batch.req_ids, rope=self.rope,
                        slots=batch.idx_mapping_np.tolist())

    def _trace_routing(self, step: int, batch: InputBatch, load: dict[int, list[int]]) -> None:
        """One event per MoE layer: how many of the step's tokens each expert received (under
        expert parallelism also each rank's share, rank r holding experts [r·E/N, (r+1)·E/N)), and
        each request's tokens' experts (best first) and routing weights."""
        qsl = batch.query_start_loc_np.tolist()
        for layer_idx, moe in self.moe_layers:
            ids, weights = moe.last_topk_ids.tolist(), moe.last_topk_weights.tolist()
            counts = load[layer_idx]
            e = moe.local_num_experts
            self.hooks.emit(MODEL_RUNNER, ROUTING, step=step, layer_idx=layer_idx, num_experts=moe.num_experts,
                            top_k=moe.top_k, expert_counts=counts,
                            rank_counts=[sum(counts[r * e:(r + 1) * e]) for r in range(moe.ep_size)],
                            topk_ids={r: ids[qsl[i]:qsl[i + 1]] for i, r in enumerate(batch.req_ids)},
                            topk_weights={r: [[round(w, 4) for w in row] for row in weights[qsl[i]:qsl[i + 1]]]
                                          for i, r in enumerate(batch.req_ids)})

    def model_input(self, input_ids, positions, slots, seq_lens, qsl, tables, logits_rows=None) -> ModelInput:
        """A batch as the model takes it, from plain lists (the warm-up's, a draft model's passes):
        each input its own tensor, named as in vLLM V1."""
        n = len(seq_lens)
        block_tables = np.zeros((n, max(map(len, tables))), np.int32)  # padded with the null block (0)
        for i, t in enumerate(tables):
            block_tables[i, :len(t)] = t
        last = np.array(qsl[1:], np.int64) - 1 if logits_rows is None else np.array(logits_rows, np.int64)
        return self._model_input(np.array(input_ids, np.int64), np.array(positions, np.int64),
                                 np.array(slots, np.int64), np.array(seq_lens, np.int32), np.array(qsl, np.int32),
                                 block_tables, last)

    def model_input_of(self, batch: InputBatch) -> ModelInput:
        """The step's batch as the model takes it (the kernels' tensors, already on its device)."""
        meta = self._metadata(batch.slot_mappings_by_group or [batch.slot_mapping], batch.query_start_loc,
                              batch.seq_lens, batch.block_tables_by_group or [batch.block_tables],
                              int(batch.num_scheduled_tokens.max()), int(batch.seq_lens_np.max()))
        meta.kv_connector = self.kv_connector
        return ModelInput(input_ids=batch.input_ids, positions=batch.positions, meta=meta,
                          logits_indices=self._tensor(batch.logits_indices),
                          all_last=len(batch.input_ids) == len(batch.req_ids))

    def _model_input(self, input_ids, positions, slots, seq_lens, qsl, block_tables, logits_indices) -> ModelInput:
        """(Every KV-cache group gets the same table and slots: the warm-up's dummy sequence.)"""
        tensor = self._tensor
        meta = self._metadata([tensor(slots)] * len(self.sliding_windows), tensor(qsl), tensor(seq_lens),
                              [tensor(block_tables)] * len(self.sliding_windows),
                              int((qsl[1:] - qsl[:-1]).max()), int(seq_lens.max()))
        return ModelInput(input_ids=tensor(input_ids), positions=tensor(positions), meta=meta,
                          logits_indices=tensor(logits_indices), all_last=len(input_ids) == len(seq_lens))

    def _metadata(self, slot_mappings, qsl, seq_lens, block_tables, max_query_len, max_seq_len) -> AttentionMetadata:
        """The first KV-cache group's metadata, holding the others' (one per group: its tables, slots, window)."""
        metas = [AttentionMetadata(slot_mapping=slots, query_start_loc=qsl, seq_lens=seq_lens, block_tables=tables,
                                   max_query_len=max_query_len, max_seq_len=max_seq_len, sliding_window=window)
                 for slots, tables, window in zip(slot_mappings, block_tables, self.sliding_windows)]
        metas[0].group_metadata, metas[0].layer_group = metas[1:], self.layer_group
        return metas[0]

    # ---- the step -------------------------------------------------------------------------------
    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        """Apply the diff, then (unless nothing was scheduled) the forward pass over the batch
        (on every tensor-parallel rank: each has the whole logits after the all-gather). Writes
        the batch's keys and values into the KV cache at slot_mapping; the logits wait for
        sample_tokens. Hooks (when active): model_runner/batch, one kernel event per Triton launch
        (published after the forward pass, or before a gate holds the engine); when gated as the
        step starts, a kernel gate before each launch. While profiling (profile()), every op is a
        launch too."""
        self.finish_requests(scheduler_output)
        self.add_requests(scheduler_output)
        self.update_requests(scheduler_output)
        self._pending = None
        if self.kv_connector is not None:  # V1's KVConnectorModelRunnerMixin: loads start before the forward pass
            self.kv_connector.bind_connector_metadata(scheduler_output.kv_connector_metadata)
            self.kv_connector.start_load_kv()
        if not scheduler_output.is_empty:
            self._observed(scheduler_output.step, lambda: self._lens(scheduler_output), self._execute,
                           scheduler_output)
        if self.kv_connector is not None:  # ... and saves finish after it
            self._finish_kv_connector(scheduler_output)

    def _finish_kv_connector(self, sched: SchedulerOutput) -> None:
        """After the forward pass (V1's): the step's saves done, the finished transfers for the scheduler."""
        connector = self.kv_connector
        connector.wait_for_save()
        sending, recving = connector.get_finished(sched.finished_req_ids)
        invalid = connector.get_block_ids_with_load_errors()
        connector.clear_connector_metadata()
        if self.hooks.active:
            connector.publish_records(sched.step)
        self._kv_connector_output = KVConnectorOutput(sending, recving, invalid or None)
        return None

    def _execute(self, sched: SchedulerOutput) -> None:
        batch = self.prepare_inputs(sched)
        self._forward_step(sched, batch, self.model_input_of(batch))

    def _lens(self, sched: SchedulerOutput) -> tuple[list[int], list[int]]:
        """Each scheduled request's query and sequence length (a profiled step's attention cost)."""
        query_lens = list(sched.num_scheduled_tokens.values())
        computed = [int(self.req_states.num_computed_tokens[self.req_states.req_id_to_index[rid]])
                    for rid in sched.num_scheduled_tokens]
        return query_lens, [c + q for c, q in zip(computed, query_lens)]

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput | None:
        """Sample the pending step's logits (after the grammar bitmask), verify its drafts, record
        each request's new tokens and propose the next drafts. Returns one entry per scheduled
        request, in batch order (none for a chunk that does not end its prefill). Hooks: the
        sampler's launches, sampler/sampled."""
        pending, self._pending = self._pending, None
        kv_output, self._kv_connector_output = self._kv_connector_output, None
        if pending is None:  # nothing ran; a KV connector may have finished transfers all the same
            return None if kv_output is None else ModelRunnerOutput([], {}, [], kv_connector_output=kv_output)
        lens = pending.batch.num_scheduled_tokens.tolist(), pending.batch.seq_lens_np.tolist()
        out = self._observed(pending.sched.step, lambda: lens, self._sample_step, pending, grammar_output)
        out.kv_connector_output = kv_output
        return out

    def take_draft_token_ids(self) -> DraftTokenIds | None:
        """The drafts proposed after the last step (V1's name), once."""
        drafts, self._draft_token_ids = self._draft_token_ids, None
        return drafts

    def _observed(self, step: int, lens, fn, *args):
        """fn(*args), its launches observed when traced or profiled (lens(): the step's query and
        sequence lengths, for a profiled step's costs)."""
        if self.profiler.active:
            return self._run_profiled(step, lens, fn, *args)
        if not self.hooks.active:
            return fn(*args)
        # A step's launches are kept as they happen and published together once its forward
        # pass is done, each with its own time (or sooner, before a gate may hold the engine).
        # Kernel gates are consulted only if a gate is on as the step starts: a stop at kernels
        # asked for in the middle of a forward pass takes effect from the next step's launches.
        before = self._before_launch if self.hooks.gated else None
        with instrument.observe(self._launches.append, before, access_maps=False, step=step):
            return fn(*args)

    def profile(self, is_start: bool = True) -> dict:
        """Start or stop profiling this rank's steps (see engine/worker/profiler.py)."""
        return self.profiler.start() if is_start else self.profiler.stop()

    def _run_profiled(self, step: int, lens, fn, *args):
        with self.profiler.step_annotation(step):
            if not self.hooks.active:  # only torch.profiler listens
                return fn(*args)
            self._profiled_lens = lens()
            before = self._before_launch if self.hooks.gated else None
            try:
                with instrument.observe(self._launches.append, before, access_maps=False, profile=True, step=step):
                    return fn(*args)
            finally:
                self._profiled_lens = None

    def forward(self, inp: ModelInput) -> torch.Tensor:
        """The model on one batch: logits of each request's last scheduled position. (Callers
        run it under torch.inference_mode().)"""
        hidden = self.model(inp.input_ids, inp.positions, self.kv_caches, inp.meta)
        return self.model.compute_logits(hidden if inp.all_last else hidden[inp.logits_indices])

    @torch.inference_mode()
    def _forward_step(self, sched: SchedulerOutput, batch: InputBatch, inp: ModelInput) -> None:
        requests = [self.req_states.requests[rid] for rid in batch.req_ids]
        rows, spans = _prompt_logprob_rows(batch, requests)
        try:
            hidden = self.model(inp.input_ids, inp.positions, self.kv_caches, inp.meta)
            logits = self.model.compute_logits(hidden if inp.all_last else hidden[inp.logits_indices])
            prompt_logits = self.model.compute_logits(hidden[rows]) if rows else None  # every rank: a collective
        finally:
            if self._launches:
                self._publish_launches()
        load = self._expert_load() if self.moe_layers else None
        if self.hooks.active and self.moe_layers and self.rank == 0:  # the same routing on every rank
            self._trace_routing(sched.step, batch, load)
        self._pending = _Pending(sched, batch, inp, requests, logits, prompt_logits, spans, load)

    def _expert_load(self) -> dict[int, list[int]]:
        """Per MoE layer, the tokens each expert received in the forward pass just run: one bincount over
        every layer's ids (each layer's offset by the experts before it) and one copy to the host a step,
        not one per layer (on a GPU each copy waits for the device)."""
        offsets, ids, total = [], [], 0
        for _, moe in self.moe_layers:
            offsets.append(total)
            ids.append(moe.last_topk_ids.flatten() + total)
            total += moe.num_experts
        counts = torch.bincount(torch.cat(ids), minlength=total).tolist()
        return {layer_idx: counts[off:off + moe.num_experts]
                for (layer_idx, moe), off in zip(self.moe_layers, offsets)}

    @torch.inference_mode()
    def _sample_step(self, p: _Pending, grammar_output: GrammarOutput | None) -> ModelRunnerOutput:
        batch, requests, logits = p.batch, p.requests, p.logits
        drafts = batch.draft_token_ids
        if grammar_output is not None:  # every scored row: what the rejection sampler and the sampler see
            self.apply_grammar_bitmask(grammar_output, logits, batch.req_ids, drafts,
                                       {rid: len(d) for rid, d in p.sched.scheduled_spec_decode_tokens.items()})
            if grammar_output.num_acceptable_drafts is not None:
                drafts, logits = _acceptable_drafts(drafts, logits, batch.req_ids, grammar_output)
        last_rows = _last_rows(drafts) if any(drafts) else None
        sample_logits = logits if last_rows is None else logits[last_rows]  # one row per request
        # the last row follows every draft: its token is drawn with them counted as output (penalties, min_tokens)
        out = self.sampler(sample_logits, requests if last_rows is None else requests_after_drafts(requests, drafts))
        kept = self._verify(logits, drafts, requests, out.token_ids) if last_rows is not None else None
        spec_lps = spec_logprobs(logits, drafts, requests, kept) if kept is not None else None
        result = self._postprocess(batch, requests, out, kept, spec_lps, drafts)
        result.expert_load = p.expert_load
        if self._launches:  # the sampler's (a grammar's mask, a verification, post_update; every op while profiling)
            self._publish_launches()
        if self.hooks.active:
            self._trace_sampled(p.sched.step, batch.req_ids, out.token_ids)
        if p.prompt_logits is not None:
            result.prompt_logprobs_dict = _prompt_logprobs(p.prompt_logits, p.spans, requests)
        if self.drafter is not None and self.rank == 0:
            self._draft_token_ids = self._propose_draft_token_ids(p.sched, batch, requests, result)
        return result

    def _postprocess(self, batch: InputBatch, requests: list, out, kept, spec_lps,
                     verified: list[list[int]]) -> ModelRunnerOutput:
        """Each request's new tokens, recorded in its state (none for a chunk that does not end its
        prefill: its token is discarded). `verified`: the drafts verified (those computed, or fewer)."""
        sampled, logprobs = [], None
        ends = batch.seq_lens_np.tolist()
        for i, req in enumerate(requests):
            d = verified[i]
            if ends[i] - len(batch.draft_token_ids[i]) < req.num_tokens:
                sampled.append([])
                continue
            tokens = kept[i] if d else [out.token_ids[i]]
            sampled.append(tokens)
            req.all_token_ids += tokens
            if out.logprobs[i] is not None:
                logprobs = logprobs or [None] * len(requests)
                logprobs[i] = spec_lps[i] if d else [(out.logprobs[i], out.ranks[i])]
        self._post_update(batch, sampled)
        return ModelRunnerOutput(batch.req_ids, {rid: i for i, rid in enumerate(batch.req_ids)}, sampled, logprobs)

    def _post_update(self, batch: InputBatch, sampled: list[list[int]]) -> None:
        """The post_update launch (V1 0.33's _post_update_kernel): each row's sampled tokens written
        after its slot's tokens, and its computed tokens advanced by its query less its rejected drafts."""
        states, buffers, n = self.req_states, self.input_buffers, len(sampled)
        num_sampled = np.fromiter(map(len, sampled), np.int32, n)
        num_rejected = np.fromiter((len(d) + 1 - len(s) if d and s else 0
                                    for d, s in zip(batch.draft_token_ids, sampled)), np.int32, n)
        tokens = np.zeros((n, max(1, int(num_sampled.max(initial=0)))), np.int64)
        for i, s in enumerate(sampled):
            tokens[i, :len(s)] = s
        states.reserve(int((states.num_tokens[batch.idx_mapping_np] + num_sampled).max(initial=0)))
        all_token_ids, total_len, computed = (buffers(name, getattr(states, name))
                                              for name in ("token_ids", "num_tokens", "num_computed_tokens"))
        self.input_kernels.post_update(idx_mapping=batch.idx_mapping, num_computed_tokens=computed,
                                       sampled_tokens=self._tensor(tokens), num_sampled=self._tensor(num_sampled),
                                       num_rejected=self._tensor(num_rejected), query_start_loc=batch.query_start_loc,
                                       all_token_ids=all_token_ids, total_len=total_len)
        for array, tensor in zip((states.token_ids, states.num_tokens, states.num_computed_tokens),
                                 (all_token_ids, total_len, computed)):
            buffers.write_back(array, tensor)

    def _propose_draft_token_ids(self, sched: SchedulerOutput, batch: InputBatch, requests: list,
                                 result: ModelRunnerOutput) -> DraftTokenIds:
        """The proposer's drafts for the next step (V1's propose_draft_token_ids), after this
        step's tokens are recorded. A draft model's launches are tagged draft, apart from the target's."""
        decoding = [(i, r) for i, r in enumerate(requests) if result.sampled_token_ids[i]]
        if isinstance(self.drafter, NgramProposer):
            proposals = self.drafter.propose_requests([r for _, r in decoding], self.max_model_len)
        else:
            tables = [self.block_tables.block_tables[r.slot, :self.block_tables.num_blocks[r.slot]].tolist()
                      for _, r in decoding]
            reset = {n.req_id for n in sched.scheduled_new_reqs} | sched.scheduled_cached_reqs.resumed_req_ids
            instrument.set_tags(draft=True, layer=None)  # a no-op unless observed
            try:
                proposals = self.drafter.propose([r for _, r in decoding], tables, reset, sched.finished_req_ids)
            finally:
                instrument.set_tags(draft=None, layer=None)
                if self._launches:
                    self._publish_launches()
        self.last_draft_token_ids = proposals  # for the next step's placeholder drafts (async scheduling)
        return DraftTokenIds(list(proposals), list(proposals.values()))

    def _verify(self, logits: torch.Tensor, drafts: list[list[int]], requests: list, bonus: list[int]):
        """Per request with drafts: the tokens the rejection sampler keeps (None for the others)."""
        if self.rejection_sampler is None:
            self.rejection_sampler = RejectionSampler(self.model.backend.name, self.sampler)
        spec = [i for i, d in enumerate(drafts) if d]
        draft_rows = [r for i, d in enumerate(drafts) for r in _draft_rows(drafts, i)]
        kept = self.rejection_sampler(logits[draft_rows], [drafts[i] for i in spec], [requests[i] for i in spec],
                                      [bonus[i] for i in spec])
        out: list = [None] * len(drafts)
        for i, tokens in zip(spec, kept):
            out[i] = tokens
        return out

    def apply_grammar_bitmask(self, grammar_output: GrammarOutput, logits: torch.Tensor, req_ids: list[str],
                              draft_token_ids: list[list[int]], num_scheduled_drafts: dict[str, int] | None = None
                              ) -> None:
        """Structured outputs (V1's name): the tokens each constrained request's grammar forbids get
        -inf, in place, before any logits processor, verification or sampling. `logits` has one row
        per scored position (1 + its drafts per request); a constrained request's mask rows follow
        grammar_output's order, 1 + its scheduled drafts each (num_scheduled_drafts; under async
        scheduling placeholders it had no draft for, whose rows go unused), the first ones for the
        positions it scores. Our Triton kernel with the triton backend, its PyTorch reference with
        torch; both are launches the Kernels panel lists."""
        first_logits_row, row = {}, 0
        for rid, d in zip(req_ids, draft_token_ids):
            first_logits_row[rid] = (row, 1 + len(d))
            row += 1 + len(d)
        logit_rows, mask_rows, mask_row = [], [], 0
        for rid in grammar_output.structured_output_request_ids:
            start, n = first_logits_row[rid]
            logit_rows += range(start, start + n)
            mask_rows += range(mask_row, mask_row + n)
            mask_row += n if num_scheduled_drafts is None else 1 + num_scheduled_drafts.get(rid, 0)
        indices = self._tensor(np.array(logit_rows, np.int32))
        masks = grammar_output.grammar_bitmask
        masks = masks if len(mask_rows) == len(masks) else masks[mask_rows]
        bitmask = self._tensor(np.ascontiguousarray(masks, np.int32))
        if self.model.backend.name == "triton":
            kernels.apply_token_bitmask(logits, bitmask, indices)
        else:
            instrument.call("apply_token_bitmask_ref", kernels.apply_token_bitmask_ref,
                            dict(logits=logits, bitmask=bitmask, indices=indices),
                            reason="attention_backend=torch: PyTorch reference")

    def _trace_sampled(self, step: int, req_ids: list[str], token_ids: list[int]) -> None:
        # what allowed_token_ids, bad_words and logit_bias did, per request that asked
        done_by_row = getattr(self.sampler, "last_processed", {})  # (a lesson may wrap the sampler)
        extra = {}
        if done_by_row:
            extra["logits_processors"] = {req_ids[i]: done for i, done in done_by_row.items()}
        # on every rank, with the rank: the trace shows that the ranks drew the same tokens
        self.hooks.emit("sampler", "sampled", step=step, token_ids=token_ids, request_ids=req_ids,
                        rank=self.rank, **extra)

    def _trace_warmup_launch(self, rec: instrument.LaunchRecord) -> None:
        self.hooks.emit(KERNEL, rec.name, layer_idx=rec.tags.get("layer"), grid=list(rec.grid), meta=rec.meta,
                        args=rec.args, duration_ns=rec.duration_ns, timing=rec.timing, reason=rec.reason,
                        rank=self.rank, warmup=True)

    @torch.inference_mode()
    def warm_up(self, max_model_len: int) -> dict:
        """Real forward passes of a dummy sequence, outside the scheduler: a prefill of up to
        block_size + 1 tokens (it spans two blocks), then one decode token reading that cache,
        so both kernel configurations (prefill and decode) are built. With the triton backend
        this compiles (or, interpreted, first runs) the kernels before a user's first request
        pays for it. It is no request and no engine step; its kernel launches are traced with
        step None and ``warmup: true``. The blocks it wrote are zeroed again afterwards."""
        bs, num_blocks = self.block_size, self.kv_caches[0][0].shape[0]
        n = max(1, min(bs + 1, max_model_len - 1, num_blocks * bs - 1))  # prompt; +1 decode token
        table = list(range(-(-(n + 1) // bs)))
        def slot(p: int) -> int:
            return table[p // bs] * bs + p % bs

        batches = [self.model_input([0] * n, list(range(n)), [slot(p) for p in range(n)], [n], [0, n], [table]),
                   self.model_input([0], [n], [slot(n)], [n + 1], [0, 1], [table])]
        launches = []

        def on_launch(rec: instrument.LaunchRecord) -> None:
            launches.append(rec.name)
            if self.hooks.active:
                self._trace_warmup_launch(rec)

        with instrument.observe(on_launch, access_maps=False, warmup=True):  # no before_launch: nothing to gate here
            for inp in batches:
                self.forward(inp)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the stage's time includes the kernels themselves
        for k, v in self.kv_caches:  # table is blocks 0..m-1: a slice, so zero_() writes in place
            k[:len(table)].zero_()
            v[:len(table)].zero_()
        return dict(num_tokens=n + 1, num_launches=len(launches), kernels=sorted(set(launches)))

    def _before_launch(self, name: str, grid: tuple, meta: dict) -> None:
        if not self.hooks.gated:  # nobody may stop the engine here: skip building the gate's info
            return
        if self._launches:  # a viewer held here sees every launch before this one
            self._publish_launches()
        tags = instrument.current_tags()
        self._held = instrument.pending_launch()
        if tags.get("draft"):  # held before a draft model's launch: named as its kernel events are
            name = DRAFT_PREFIX + name
        try:
            self.hooks.gate(KERNEL, name=name, grid=grid, step=tags.get("step"), layer_idx=tags.get("layer"))
        finally:
            self._held = None

    def held_attention_on_triton(self) -> dict:
        """While a gate holds the engine before an attention launch: run that launch's inputs
        through the Triton kernel (kernels.rerun); plain data back. Called from another thread
        (the engine's is the one held); the inputs are copied first."""
        from kernels.rerun import attention_inputs, attention_on_triton, moe_inputs, moe_on_triton

        held = self._held
        if held is not None and held[0] == "fused_moe_ref":  # a mixture of experts' layer: its grouped GEMMs
            return moe_on_triton(**moe_inputs(held[1]))
        if held is None or not is_attention_kernel(held[0]):
            raise ValueError("the engine is not held before an attention or fused-MoE launch (press k until it is)")
        return attention_on_triton(**attention_inputs(held[1]))

    def _publish_launches(self) -> None:
        # Plain data only: viewers recompute a launch's access map from the step's batch event
        recs = self._launches
        rank = self.rank
        attrs = [{"layer_idx": r.tags.get("layer"), "grid": list(r.grid), "meta": r.meta, "args": r.args,
                  "duration_ns": r.duration_ns, "timing": r.timing, "reason": r.reason, "rank": rank} for r in recs]
        if self._profiled_lens is not None:  # (the lengths are the target's batch's: not the draft model's launches)
            target = [(r, a) for r, a in zip(recs, attrs) if not r.tags.get("draft")]
            self._add_costs([r for r, _ in target], [a for _, a in target])
        # the draft model's launches are named apart (draft:...): their own rows, history and no access
        # map (the step's batch event describes the target's pass, not theirs)
        names = [DRAFT_PREFIX + r.name if r.tags.get("draft") else r.name for r in recs]
        self.hooks.emit_many([(KERNEL, n, INSTANT, None, r.tags.get("step"), a) for n, r, a in zip(names, recs, attrs)],
                             [r.end_ns for r in recs])
        recs.clear()

    def _add_costs(self, recs: list[instrument.LaunchRecord], attrs: list[dict]) -> None:
        """A profiled step's launches get their op kind, FLOPs and bytes (kernels.op_cost), computed
        now that the step's ops have run. Every layer repeats the same shapes: each distinct
        (name, shapes) is computed once (attention's cost also depends on the batch's lengths)."""
        query_lens, seq_lens = self._profiled_lens
        costs = self._costs
        if len(costs) > 4096:  # one entry per op per batch shape: start again
            costs.clear()
        for r, a in zip(recs, attrs):
            key = (r.name, r.raw_args)
            cost = costs.get(key)
            if cost is None:
                cost = launch_cost(r.name, r.op, a["args"], r.meta, query_lens, seq_lens)
                if cost[0] != ATTENTION:
                    costs[key] = cost
            a["op"], a["flops"], a["bytes"] = cost
            a["profiled"] = True


def _prompt_logprob_rows(batch: InputBatch, requests: list) -> tuple[list[int], list[tuple[int, int, int]]]:
    """The rows whose logits score the next prompt token, for requests that asked for prompt
    logprobs (the row at position j scores prompt token j + 1), and per such request its
    (index in the batch, first position, number of rows)."""
    rows, spans, row = [], [], 0
    for i, (req, n, end) in enumerate(zip(requests, batch.num_scheduled_tokens.tolist(), batch.seq_lens_np.tolist())):
        if req.params.prompt_logprobs is not None:
            first = end - n
            count = min(end, req.num_prompt_tokens - 1) - first
            if count > 0:
                rows += range(row, row + count)
                spans.append((i, first, count))
        row += n
    return rows, spans


def _prompt_logprobs(logits: torch.Tensor, spans: list[tuple[int, int, int]], requests: list) -> dict:
    """Request id -> (first position, one entry per row: the next prompt token's [token id,
    logprob, rank], then the top-k [token id, logprob, rank])."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    out = {}
    r = 0
    for i, first, count in spans:
        req, block = requests[i], lp[r:r + count]
        r += count
        targets = req.all_token_ids[first + 1:first + 1 + count]
        own = block.gather(1, torch.tensor(targets, device=block.device)[:, None])[:, 0]
        ranks = ((block > own[:, None]).sum(1) + 1).tolist()
        k = req.params.prompt_logprobs
        top = block.topk(k, dim=-1) if k else None
        top_ids, top_lps = (top.indices.tolist(), top.values.tolist()) if k else ([[]] * count, [[]] * count)
        own = own.tolist()
        out[req.req_id] = (first, [[[t, own[j], ranks[j]], *([u, v, n + 1] for n, (u, v) in enumerate(zip(ids, lps)))]
                                   for j, (t, ids, lps) in enumerate(zip(targets, top_ids, top_lps))])
    return out


def _acceptable_drafts(drafts: list[list[int]], logits: torch.Tensor, req_ids: list[str],
                       grammar_output: GrammarOutput) -> tuple[list[list[int]], torch.Tensor]:
    """V1's invalid drafts: under async scheduling a constrained request may have computed drafts its
    grammar then refused (or rows past a -1, which allow every token). Only the drafts its rows
    constrain are verified (num_acceptable_drafts), and the row after them is sampled as the bonus
    position, as the synchronous step, which never scheduled the others, samples it; the rest of its
    rows are dropped. Returns the drafts verified and their logits rows."""
    limit = dict(zip(grammar_output.structured_output_request_ids, grammar_output.num_acceptable_drafts))
    cut = [d[:limit[rid]] if rid in limit else d for rid, d in zip(req_ids, drafts)]
    if all(len(c) == len(d) for c, d in zip(cut, drafts)):
        return drafts, logits
    rows, start = [], 0
    for c, d in zip(cut, drafts):
        rows += range(start, start + len(c) + 1)
        start += len(d) + 1
    return cut, logits[rows]


def _last_rows(drafts: list[list[int]]) -> list[int]:
    """With draft tokens each request has len(drafts) + 1 logits rows: the last one is sampled as usual."""
    rows, row = [], -1
    for d in drafts:
        row += len(d) + 1
        rows.append(row)
    return rows


def _draft_rows(drafts: list[list[int]], i: int) -> range:
    """The logits rows that score request i's draft tokens (the rows before its last one)."""
    start = sum(len(d) + 1 for d in drafts[:i])
    return range(start, start + len(drafts[i]))
