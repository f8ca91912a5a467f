"""The offline API, as in vLLM: ``LLM(model=...).generate(prompts, sampling_params)``.

``LLM`` is a thin shell over ``LLMEngine`` (vLLM V1's ``entrypoints/llm.py``). By default the
engine core runs in this process behind an ``InprocClient``, so a lesson can read its objects
(``llm.llm_engine.engine_core.engine_core.scheduler``, ...). ``LLM(..., multiprocess=True)``
runs the engine core in its own process, as ``serve`` does, behind a ``SyncMPClient``.
Keyword arguments are EngineArgs' fields (``engine/arg_utils.py``), with its defaults.
"""
from __future__ import annotations

import atexit
from dataclasses import replace
from itertools import count
from typing import Sequence

from engine.arg_utils import engine_config
from engine.config import ModelConfig
from engine.engine.llm_engine import LLMEngine
from engine.gc_utils import free_dropped_engines, freeze_gc_heap
from engine.hooks import Hooks
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str = ModelConfig.model, *, hooks: Hooks | None = None, multiprocess: bool = False,
                 **kwargs):
        config = engine_config(model, **kwargs)
        self.llm_engine = LLMEngine(config, hooks, multiprocess=multiprocess)
        self._ids = count()
        if multiprocess:
            atexit.register(self.shutdown)
        freeze_gc_heap()

    def get_tokenizer(self):
        return self.llm_engine.get_tokenizer()

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache (vLLM's ``LLM.reset_prefix_cache``): the next prompts share
        no blocks with earlier ones. False while requests hold blocks (never between generate calls)."""
        return self.llm_engine.reset_prefix_cache()

    def start_profile(self) -> dict:
        """Profile every op of the forward pass from the next step on (vLLM's ``LLM.start_profile``):
        each is a kernel launch in the trace, with its op kind, FLOPs and bytes; with
        ``profiler_dir`` (or $VLLM_TORCH_PROFILER_DIR) torch.profiler records the window too."""
        return self.llm_engine.start_profile()

    def stop_profile(self) -> dict:
        """End the window start_profile() opened; with a profiler_dir, each rank's "trace_file"."""
        return self.llm_engine.stop_profile()

    def shutdown(self) -> None:
        """Stop the engine-core process (multiprocess=True) and the tensor-parallel workers (also at
        exit), and give back the memory of an in-process engine: its model and KV cache are freed
        even though construction froze the heap (``gc.freeze`` keeps frozen cycles forever), so a
        second LLM in the same process finds the device memory free. Safe to call twice."""
        atexit.unregister(self.shutdown)
        if self.llm_engine is None:
            return
        self.llm_engine.shutdown()
        self.llm_engine = None
        free_dropped_engines()

    def generate(self, prompts: str | dict | Sequence[str | dict],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Run every prompt to its end; outputs in the prompts' order. priority: one per prompt (lower
        first), used when the engine's scheduling_policy is "priority" (as vLLM's LLM.generate)."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (
            [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        )
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params must be one or one per prompt ({len(prompts)}), got {len(params)}")
        priority = [0] * len(prompts) if priority is None else list(priority)
        if len(priority) != len(prompts):
            raise ValueError(f"priority must be one per prompt ({len(prompts)}), got {len(priority)}")
        # As vLLM's LLM: only finished requests need an output (no RequestOutput per step)
        params = [p if p.output_kind == "final_only" else replace(p, output_kind="final_only") for p in params]
        engine = self.llm_engine
        ids = []
        try:
            for prompt, p, prio in zip(prompts, params, priority):
                ids.append(engine.add_request(str(next(self._ids)), prompt, p, priority=prio))
        except (ValueError, RuntimeError):
            engine.abort_request(ids)  # all or nothing: don't leave half a batch queued
            raise
        return self._run_engine(ids, use_tqdm)

    def _run_engine(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        finished: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(ids), desc="Processed prompts", unit="req", dynamic_ncols=True)
        try:
            while len(finished) < len(ids) and engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished and out.request_id in ids:
                        finished[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        return [finished[i] for i in ids]
