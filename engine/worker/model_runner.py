"""The model runner: one flattened batch per step -> one forward pass -> sampled tokens.

All scheduled tokens of all requests are concatenated (no padding). For each token we
know its position and its slot in the paged cache (slot = physical block * block_size +
offset, looked up in the request's block table). Only each request's last position is
projected to logits. The positions feed GPT-2's learned position table or, for a RoPE model
(Llama, Qwen3), the rotation of q and k; the batch event then says so (``rope``), and each
layer's ``rotary_embedding`` launch precedes its cache write.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

import kernels
from engine.core.sched.output import SchedulerOutput
from engine.hooks import INSTANT, Hooks
from engine.model_executor.layers.attention import AttentionMetadata
from engine.sample.rejection_sampler import RejectionSampler, requests_after_drafts, spec_logprobs
from engine.sample.sampler import Sampler, SamplerOutput
from engine.trace_names import BATCH, DRAFT_PREFIX, KERNEL, MODEL_RUNNER
from engine.worker.profiler import Profiler
from kernels import instrument
from kernels.op_cost import ATTENTION, launch_cost


@dataclass
class ModelInput:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # last scheduled position of each request
    all_last: bool = False  # every row is some request's last (all decodes): no rows to pick


class ModelRunner:
    """Runs a scheduled batch through the model: flattens it into one token list with its
    paged-attention metadata (positions, slot_mapping, seq_lens, query_start_loc, block_tables),
    runs the forward pass over the KV caches it was given and samples one token per request. It
    holds no request state: the scheduler decides what runs, the engine applies the result."""

    def __init__(self, model: nn.Module, kv_caches, block_size: int, device: torch.device, hooks: Hooks | None = None,
                 rank: int = 0, profiler_dir: str | None = None):
        self.model = model
        self.rank = rank  # tensor-parallel rank: in every kernel event and sampler/sampled
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler(model.backend.name)  # every live request's sampling settings, by slot
        self.rejection_sampler: RejectionSampler | None = None  # made on the first step with draft tokens
        self.drafter = None  # speculative decoding with a draft model: a DraftModelProposer (set by the Worker)
        self.rope = getattr(model, "rope", None)  # what the positions rotate by (None: a learned position table)
        self.hooks = hooks or Hooks()
        # numpy array -> tensor on the model's device (no copy on the CPU)
        self._tensor = torch.from_numpy if device.type == "cpu" else lambda a: torch.from_numpy(a).to(device)
        self._launches: list[instrument.LaunchRecord] = []  # this step's, not yet published
        self._held: tuple[str, dict] | None = None  # (name, arguments) of the launch a gate holds before
        self.profiler = Profiler(model, rank, profiler_dir)  # every op a launch, on demand (profile())
        self._profiled_lens: tuple[list[int], list[int]] | None = None  # a profiled step's query and sequence lengths
        self._costs: dict[tuple, tuple[str, int, int]] = {}  # (launch name, its arguments) -> (op, FLOPs, bytes)

    def prepare_inputs(self, sched: SchedulerOutput) -> ModelInput:
        bs = self.block_size
        input_ids, positions, slots, seq_lens, qsl, tables = [], [], [], [], [0], []
        for s in sched.scheduled:
            start, end = s.num_computed_before, s.num_computed_before + s.num_tokens
            table = s.request.block_ids
            if s.num_tokens == 1:  # a decode, the common case: no slices or ranges to build
                input_ids.append(s.request.all_token_ids[start])
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:  # a prefill chunk, or a decode with draft tokens to verify after its last token
                input_ids += s.request.all_token_ids[start:end] + s.spec_token_ids
                positions += range(start, end)
                slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
            seq_lens.append(end)
            qsl.append(qsl[-1] + s.num_tokens)
            tables.append(table)
        rows = None
        if any(s.spec_token_ids for s in sched.scheduled):  # every draft's row is scored, not only the last
            rows = [r for i, s in enumerate(sched.scheduled) for r in range(qsl[i + 1] - 1 - len(s.spec_token_ids),
                                                                             qsl[i + 1])]
        inp = self.model_input(input_ids, positions, slots, seq_lens, qsl, tables, rows)
        if self.hooks.active and self.rank == 0:  # the same on every rank: traced once
            self._trace_batch(sched, inp, input_ids, positions, slots, seq_lens, qsl)
        return inp

    def _trace_batch(self, sched: SchedulerOutput, inp: ModelInput, input_ids, positions, slots, seq_lens, qsl):
        self.hooks.emit(MODEL_RUNNER, BATCH, step=sched.step, input_ids=input_ids, positions=positions,
                        slot_mapping=slots, seq_lens=seq_lens, query_start_loc=qsl,
                        block_tables=inp.meta.block_tables.tolist(), request_ids=sched.req_ids, rope=self.rope)

    def model_input(self, input_ids, positions, slots, seq_lens, qsl, tables, logits_rows=None) -> ModelInput:
        """A batch as the model takes it, from plain lists (the step's, the warm-up's, a draft
        model's passes): each input its own tensor, named as in vLLM V1 (numpy first:
        torch.from_numpy is the cheapest way in from a Python list)."""
        n, T = len(seq_lens), len(input_ids)
        block_tables = np.zeros((n, max(map(len, tables))), np.int32)  # padded with the null block (0)
        for i, t in enumerate(tables):
            block_tables[i, :len(t)] = t
        tensor = self._tensor
        meta = AttentionMetadata(
            slot_mapping=tensor(np.array(slots, np.int64)),
            query_start_loc=tensor(np.array(qsl, np.int32)),
            seq_lens=tensor(np.array(seq_lens, np.int32)),
            block_tables=tensor(block_tables),
            max_query_len=max(b - a for a, b in zip(qsl, qsl[1:])),
            max_seq_len=max(seq_lens),
        )
        last = np.array(qsl[1:], np.int64) - 1 if logits_rows is None else np.array(logits_rows, np.int64)
        return ModelInput(input_ids=tensor(np.array(input_ids, np.int64)),
                          positions=tensor(np.array(positions, np.int64)), meta=meta,
                          logits_indices=tensor(last), all_last=T == n)

    def execute(self, sched: SchedulerOutput) -> SamplerOutput:
        """One forward pass and sampling for a non-empty SchedulerOutput (on every
        tensor-parallel rank: each has the whole logits after the all-gather).

        Returns one sampled token (with logprobs and ranks when asked for) per scheduled request,
        in ``sched.scheduled`` order; a prefill chunk that does not end its prompt gets one too,
        which the engine discards. Changes: writes the batch's keys and values into the KV cache
        at slot_mapping, nothing else. Hooks (when active): model_runner/batch, one kernel event
        per Triton launch (published after the forward pass and after sampling, or before a gate
        holds the engine), sampler/sampled; when gated as the step starts, a kernel gate before
        each launch. While profiling (profile()), every op of the forward pass and of the sampler
        is a launch too."""
        self.sampler.finish_requests(sched.finished_req_ids)  # their slots are free again
        inp = self.prepare_inputs(sched)
        if self.profiler.active:
            return self._run_profiled(sched, inp)
        if not self.hooks.active:
            return self._run(sched, inp)
        # A step's launches are kept as they happen and published together once its forward
        # pass is done, each with its own time (or sooner, before a gate may hold the engine).
        # Kernel gates are consulted only if a gate is on as the step starts: a stop at kernels
        # asked for in the middle of a forward pass takes effect from the next step's launches.
        before = self._before_launch if self.hooks.gated else None
        with instrument.observe(self._launches.append, before, access_maps=False, step=sched.step):
            return self._run(sched, inp)

    def profile(self, is_start: bool = True) -> dict:
        """Start or stop profiling this rank's steps (see engine/worker/profiler.py)."""
        return self.profiler.start() if is_start else self.profiler.stop()

    def _run_profiled(self, sched: SchedulerOutput, inp: ModelInput) -> SamplerOutput:
        with self.profiler.step_annotation(sched.step):
            if not self.hooks.active:  # only torch.profiler listens
                return self._run(sched, inp)
            qsl = inp.meta.query_start_loc.tolist()
            self._profiled_lens = ([b - a for a, b in zip(qsl, qsl[1:])], inp.meta.seq_lens.tolist())
            before = self._before_launch if self.hooks.gated else None
            try:
                with instrument.observe(self._launches.append, before, access_maps=False, profile=True,
                                        step=sched.step):
                    return self._run(sched, inp)
            finally:
                self._profiled_lens = None

    def forward(self, inp: ModelInput) -> torch.Tensor:
        """The model on one batch: logits of each request's last scheduled position. (Callers
        run it under torch.inference_mode().)"""
        hidden = self.model(inp.input_ids, inp.positions, self.kv_caches, inp.meta)
        return self.model.compute_logits(hidden if inp.all_last else hidden[inp.logits_indices])

    @torch.inference_mode()
    def _run(self, sched: SchedulerOutput, inp: ModelInput) -> SamplerOutput:
        rows, spans = _prompt_logprob_rows(sched)
        try:
            hidden = self.model(inp.input_ids, inp.positions, self.kv_caches, inp.meta)
            logits = self.model.compute_logits(hidden if inp.all_last else hidden[inp.logits_indices])
            prompt_logits = self.model.compute_logits(hidden[rows]) if rows else None  # every rank: a collective
        finally:
            if self._launches:
                self._publish_launches()
        drafts = [s.spec_token_ids for s in sched.scheduled]
        last_rows = _last_rows(drafts) if any(drafts) else None
        if sched.grammar_bitmask is not None:  # every scored row: what the rejection sampler and the sampler see
            self.apply_grammar_bitmask(sched, logits)
        sample_logits = logits if last_rows is None else logits[last_rows]  # one row per request
        requests = [s.request for s in sched.scheduled]
        # the last row follows every draft: its token is drawn with them counted as output (penalties, min_tokens)
        out = self.sampler(sample_logits, requests if last_rows is None else requests_after_drafts(requests, drafts))
        if rows:
            out.prompt_logprobs = _prompt_logprobs(prompt_logits, spans, sched)
        if last_rows is not None:
            out.spec_token_ids = self._verify(logits, drafts, sched, out.token_ids)
            out.spec_logprobs = spec_logprobs(logits, drafts, requests, out.spec_token_ids)
        if self._launches:  # the sampler's (a grammar's mask, a verification; every step's op while profiling)
            self._publish_launches()
        if self.hooks.active:
            self._trace_sampled(sched, out)
        if self.drafter is not None:
            out.draft_token_ids = self._propose_draft_token_ids(sched, out)
        return out

    def _propose_draft_token_ids(self, sched: SchedulerOutput, out: SamplerOutput) -> dict[str, list[int]]:
        """The draft model's proposals for the next step (V1's propose_draft_token_ids), after this
        step's tokens are known. Its kernel launches are tagged draft, apart from the target's."""
        instrument.set_tags(draft=True, layer=None)  # a no-op unless observed
        try:
            return self.drafter.propose(sched, out.token_ids, out.spec_token_ids)
        finally:
            instrument.set_tags(draft=None, layer=None)
            if self._launches:
                self._publish_launches()

    def _verify(self, logits: torch.Tensor, drafts: list[list[int]], sched: SchedulerOutput, bonus: list[int]):
        """Per request with drafts: the tokens the rejection sampler keeps (None for the others)."""
        if self.rejection_sampler is None:
            self.rejection_sampler = RejectionSampler(self.model.backend.name, self.sampler)
        spec = [i for i, d in enumerate(drafts) if d]
        draft_rows = [r for i, d in enumerate(drafts) for r in _draft_rows(drafts, i)]
        kept = self.rejection_sampler(logits[draft_rows], [drafts[i] for i in spec],
                                      [sched.scheduled[i].request for i in spec], [bonus[i] for i in spec])
        out: list = [None] * len(drafts)
        for i, tokens in zip(spec, kept):
            out[i] = tokens
        return out

    def apply_grammar_bitmask(self, sched: SchedulerOutput, logits: torch.Tensor) -> None:
        """Structured outputs (V1's name): the tokens each constrained request's grammar forbids get
        -inf, in place, before any logits processor, verification or sampling. `logits` has one row
        per scored position (1 + its drafts per request); a constrained request's mask row j goes to
        its logits row j. Our Triton kernel with the triton backend, its PyTorch reference with
        torch; both are launches the Kernels panel lists."""
        first_logits_row, row = {}, 0
        for s in sched.scheduled:
            first_logits_row[s.request.request_id] = (row, 1 + len(s.spec_token_ids))
            row += 1 + len(s.spec_token_ids)
        rows = np.empty(len(sched.grammar_bitmask), np.int32)
        for rid, first_mask_row in sched.structured_output_request_ids.items():
            start, n = first_logits_row[rid]
            rows[first_mask_row:first_mask_row + n] = np.arange(start, start + n)
        indices = self._tensor(rows)
        bitmask = self._tensor(np.ascontiguousarray(sched.grammar_bitmask, np.int32))
        if self.model.backend.name == "triton":
            kernels.apply_token_bitmask(logits, bitmask, indices)
        else:
            instrument.call("apply_token_bitmask_ref", kernels.apply_token_bitmask_ref,
                            dict(logits=logits, bitmask=bitmask, indices=indices),
                            reason="attention_backend=torch: PyTorch reference")

    def _trace_sampled(self, sched: SchedulerOutput, out: SamplerOutput) -> None:
        # what allowed_token_ids, bad_words and logit_bias did, per request that asked
        done_by_row = getattr(self.sampler, "last_processed", {})  # (a lesson may wrap the sampler)
        extra = {}
        if done_by_row:
            extra["logits_processors"] = {sched.req_ids[i]: done for i, done in done_by_row.items()}
        # on every rank, with the rank: the trace shows that the ranks drew the same tokens
        self.hooks.emit("sampler", "sampled", step=sched.step, token_ids=out.token_ids, request_ids=sched.req_ids,
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
        from kernels.rerun import attention_inputs, attention_on_triton

        held = self._held
        if held is None or not held[0].startswith("unified_attention"):
            raise ValueError("the engine is not held before an attention launch (press k until it is)")
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


def _prompt_logprob_rows(sched: SchedulerOutput) -> tuple[list[int], list[tuple[int, int, int]]]:
    """The rows whose logits score the next prompt token, for requests that asked for prompt
    logprobs (the row at position j scores prompt token j + 1), and per such request its
    (index in the batch, first position, number of rows)."""
    rows, spans, row = [], [], 0
    for i, s in enumerate(sched.scheduled):
        req = s.request
        if req.params.prompt_logprobs is not None:
            first = s.num_computed_before
            count = min(first + s.num_tokens, req.num_prompt_tokens - 1) - first
            if count > 0:
                rows += range(row, row + count)
                spans.append((i, first, count))
        row += s.num_tokens
    return rows, spans


def _prompt_logprobs(logits: torch.Tensor, spans: list[tuple[int, int, int]], sched: SchedulerOutput) -> list:
    """Per scheduled request: None, or (first position, one entry per row: the next prompt token's
    [token id, logprob, rank], then the top-k [token id, logprob, rank])."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    out: list = [None] * len(sched.scheduled)
    r = 0
    for i, first, count in spans:
        req, block = sched.scheduled[i].request, lp[r:r + count]
        r += count
        targets = req.all_token_ids[first + 1:first + 1 + count]
        own = block.gather(1, torch.tensor(targets, device=block.device)[:, None])[:, 0]
        ranks = ((block > own[:, None]).sum(1) + 1).tolist()
        k = req.params.prompt_logprobs
        top = block.topk(k, dim=-1) if k else None
        top_ids, top_lps = (top.indices.tolist(), top.values.tolist()) if k else ([[]] * count, [[]] * count)
        own = own.tolist()
        out[i] = (first, [[[t, own[j], ranks[j]], *([u, v, n + 1] for n, (u, v) in enumerate(zip(ids, lps)))]
                          for j, (t, ids, lps) in enumerate(zip(targets, top_ids, top_lps))])
    return out


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
