"""The offline API, as in vLLM: ``LLM(model=...).generate(prompts, sampling_params)``.

By default the engine runs in this process (vLLM's InprocClient), so a lesson can read its
objects (``llm.llm_engine.scheduler``, ...). ``LLM(..., multiprocess=True)`` runs the engine
core in its own process, as ``serve`` does: ``llm_engine`` is then None, and generate() goes
through an AsyncLLM driven on a private event loop.
"""
from __future__ import annotations

import asyncio
import atexit
import threading
from dataclasses import replace
from itertools import count
from typing import Sequence

from engine.config import engine_config
from engine.engine.llm_engine import LLMEngine
from engine.gc_utils import freeze_gc_heap
from engine.hooks import Hooks
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str = "tiny-gpt2", *, block_size: int = 16, num_kv_blocks: int | None = None,
                 kv_cache_memory: int | None = None, gpu_memory_utilization: float = 0.9,
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 2048, max_model_len: int | None = None,
                 enable_prefix_caching: bool = True, enable_chunked_prefill: bool = True,
                 attention_backend: str | None = None, dtype: str | None = None, device: str | None = None,
                 seed: int = 0, tensor_parallel_size: int = 1, distributed_init_method: str | None = None,
                 distributed_timeout_s: float = 30.0, hooks: Hooks | None = None, multiprocess: bool = False):
        config = engine_config(
            model, block_size=block_size, num_kv_blocks=num_kv_blocks, kv_cache_memory=kv_cache_memory,
            gpu_memory_utilization=gpu_memory_utilization, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
            enable_prefix_caching=enable_prefix_caching, enable_chunked_prefill=enable_chunked_prefill,
            attention_backend=attention_backend, dtype=dtype, device=device, seed=seed,
            tensor_parallel_size=tensor_parallel_size, distributed_init_method=distributed_init_method,
            distributed_timeout_s=distributed_timeout_s)
        self._core = None
        if multiprocess:
            self.llm_engine = None
            self._core = _CoreProcess(config, hooks)
            return
        self.llm_engine = LLMEngine(config, hooks)
        freeze_gc_heap()

    def get_tokenizer(self):
        return self._core.llm.tokenizer if self._core is not None else self.llm_engine.tokenizer

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache (vLLM's ``LLM.reset_prefix_cache``): the next prompts share
        no blocks with earlier ones. False while requests hold blocks (never between generate calls)."""
        if self._core is not None:
            return self._core.llm.client.call("reset_prefix_cache")
        return self.llm_engine.reset_prefix_cache()

    def shutdown(self) -> None:
        """Stop the engine-core process (multiprocess=True) and the tensor-parallel workers (also at
        exit). Safe to call twice."""
        if self._core is not None:
            self._core.close()
        else:
            self.llm_engine.shutdown()

    def generate(self, prompts: str | dict | Sequence[str | dict],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (
            [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        )
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params must be one or one per prompt ({len(prompts)}), got {len(params)}")
        # As vLLM's LLM: only finished requests need an output (no RequestOutput per step)
        params = [p if p.output_kind == "final_only" else replace(p, output_kind="final_only") for p in params]
        if self._core is not None:
            return self._core.generate(list(prompts), params, use_tqdm)
        engine = self.llm_engine
        ids = []
        try:
            for prompt, p in zip(prompts, params):
                ids.append(engine.add_request(None, prompt, p).request_id)
        except ValueError:
            for rid in ids:  # all or nothing: don't leave half a batch queued
                engine.abort_request(rid)
            raise
        return self._run(ids, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
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


class _CoreProcess:
    """LLM's engine core in its own process: an AsyncLLM on an event loop in a daemon thread."""

    def __init__(self, config, hooks: Hooks | None):
        from engine.engine.async_llm import AsyncLLM

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="llm-core-client", daemon=True)
        self.thread.start()
        self.llm = AsyncLLM(config, hooks, core_options={"trace": hooks is not None})
        self.llm.start()  # launched from the caller's thread, which outlives the core
        self._ids = count()
        self._closed = False
        atexit.register(self.close)

    def generate(self, prompts: list, params: list[SamplingParams], use_tqdm: bool) -> list[RequestOutput]:
        return asyncio.run_coroutine_threadsafe(self._generate(prompts, params, use_tqdm), self.loop).result()

    async def _generate(self, prompts, params, use_tqdm: bool) -> list[RequestOutput]:
        # all sent at once (the core takes them in one step, as LLMEngine would), all or nothing
        added = await asyncio.gather(*(self.llm.add_request(str(next(self._ids)), prompt, p)
                                       for prompt, p in zip(prompts, params)), return_exceptions=True)
        errors = [x for x in added if isinstance(x, BaseException)]
        if errors:
            for x in added:
                if not isinstance(x, BaseException):
                    x.abort()
            raise errors[0]
        streams = added
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(streams), desc="Processed prompts", unit="req", dynamic_ncols=True)

        async def final(stream):
            last = None
            async for out in stream:
                last = out
            if bar is not None:
                bar.update(1)
            return last
        try:
            return list(await asyncio.gather(*(final(s) for s in streams)))
        finally:
            if bar is not None:
                bar.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        self.llm.stop(0)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
