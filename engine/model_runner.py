"""The model runner: one flattened batch per step -> one forward pass -> sampled tokens.

All scheduled tokens of all requests are concatenated (no padding). For each token we
know its position and its slot in the paged cache (slot = physical block * block_size +
offset, looked up in the request's block table). Only each request's last position is
projected to logits.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from kernels import instrument

from engine.attention import AttentionMetadata
from engine.hooks import Hooks
from engine.model import GPT2Model
from engine.sampler import Sampler, SamplerOutput
from engine.scheduler import SchedulerOutput


@dataclass
class ModelInput:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # last scheduled position of each request


class ModelRunner:
    def __init__(self, model: GPT2Model, kv_caches, block_size: int, device: torch.device, hooks: Hooks | None = None):
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler()
        self.hooks = hooks or Hooks()

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
            else:
                input_ids += s.request.all_token_ids[start:end]
                positions += range(start, end)
                slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
            seq_lens.append(end)
            qsl.append(qsl[-1] + s.num_tokens)
            tables.append(table)
        width = max(map(len, tables))
        tables = [t + [0] * (width - len(t)) for t in tables]
        if self.hooks.active: self.hooks.emit("model_runner", "batch", step=sched.step, input_ids=input_ids, positions=positions, slot_mapping=slots, seq_lens=seq_lens, query_start_loc=qsl, block_tables=tables, request_ids=[s.request.request_id for s in sched.scheduled])
        return self._model_input(input_ids, positions, slots, seq_lens, qsl, tables)

    def _model_input(self, input_ids, positions, slots, seq_lens, qsl, tables) -> ModelInput:
        # Lists of ints become tensors through numpy: several times faster than torch.tensor.
        def tensor(values, dtype):
            return torch.from_numpy(np.array(values, dtype=dtype)).to(self.device)

        meta = AttentionMetadata(
            slot_mapping=tensor(slots, np.int64),
            query_start_loc=tensor(qsl, np.int32),
            seq_lens=tensor(seq_lens, np.int32),
            block_tables=tensor(tables, np.int32),
            max_query_len=max(b - a for a, b in zip(qsl, qsl[1:])),
            max_seq_len=max(seq_lens),
        )
        return ModelInput(
            input_ids=tensor(input_ids, np.int64),
            positions=tensor(positions, np.int64),
            meta=meta,
            logits_indices=tensor([i - 1 for i in qsl[1:]], np.int64),
        )

    def execute(self, sched: SchedulerOutput) -> SamplerOutput:
        inp = self.prepare_inputs(sched)
        if not self.hooks.active:
            return self._run(sched, inp)
        with instrument.observe(self._on_launch, self._before_launch, step=sched.step):
            return self._run(sched, inp)

    @torch.inference_mode()
    def _run(self, sched: SchedulerOutput, inp: ModelInput) -> SamplerOutput:
        hidden = self.model(inp.input_ids, inp.positions, self.kv_caches, inp.meta)
        logits = self.model.compute_logits(hidden[inp.logits_indices])
        out = self.sampler(logits, [s.request for s in sched.scheduled])
        if self.hooks.active: self.hooks.emit("sampler", "sampled", step=sched.step, token_ids=out.token_ids, request_ids=[s.request.request_id for s in sched.scheduled])
        return out

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
        slot = lambda p: table[p // bs] * bs + p % bs  # noqa: E731
        batches = [self._model_input([0] * n, list(range(n)), [slot(p) for p in range(n)], [n], [0, n], [table]),
                   self._model_input([0], [n], [slot(n)], [n + 1], [0, 1], [table])]
        launches = []

        def on_launch(rec: instrument.LaunchRecord) -> None:
            launches.append(rec.name)
            if self.hooks.active: self.hooks.emit("kernel", rec.name, layer_idx=rec.tags.get("layer"), grid=list(rec.grid), meta=rec.meta, args=rec.args, duration_ns=rec.duration_ns, timing=rec.timing, reason=rec.reason, warmup=True, launch=rec)

        with instrument.observe(on_launch, warmup=True):  # no before_launch: nothing to gate here
            for inp in batches:
                hidden = self.model(inp.input_ids, inp.positions, self.kv_caches, inp.meta)
                self.model.compute_logits(hidden[inp.logits_indices])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the stage's time includes the kernels themselves
        for k, v in self.kv_caches:  # table is blocks 0..m-1: a slice, so zero_() writes in place
            k[:len(table)].zero_()
            v[:len(table)].zero_()
        return dict(num_tokens=n + 1, num_launches=len(launches), kernels=sorted(set(launches)))

    def _before_launch(self, name: str, grid: tuple, meta: dict) -> None:
        tags = instrument.current_tags()
        self.hooks.gate("kernel", name=name, grid=grid, step=tags.get("step"), layer_idx=tags.get("layer"))

    def _on_launch(self, rec: instrument.LaunchRecord) -> None:
        # `launch` is the record itself (not JSON): live viewers read its lazy access map
        self.hooks.emit("kernel", rec.name, step=rec.tags.get("step"), layer_idx=rec.tags.get("layer"), grid=list(rec.grid), meta=rec.meta, args=rec.args, duration_ns=rec.duration_ns, timing=rec.timing, reason=rec.reason, launch=rec)
