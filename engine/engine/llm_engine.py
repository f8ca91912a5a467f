"""LLMEngine: the synchronous front end (vLLM V1's ``v1/engine/llm_engine.py``).

    add_request: Processor (prompt -> EngineCoreRequest) -> OutputProcessor.add -> client.add_request
    step():      client.get_output() (one EngineCore step) -> OutputProcessor -> RequestOutputs;
                 requests a stop string finished are aborted in the core ("stop")

The client is an ``InprocClient`` (the EngineCore in this process: what the offline ``LLM``
and the lessons use, ``llm_engine.engine_core.engine_core``) or, with multiprocess=True, a
``SyncMPClient`` (the core in its own process, as under ``serve``).
"""
from __future__ import annotations

from engine.config import EngineConfig
from engine.engine.core_client import EngineCoreClient
from engine.engine.input_processor import InputProcessor
from engine.engine.output_processor import OutputProcessor
from engine.engine.parallel_sampling import fan_out
from engine.hooks import Hooks
from engine.model_executor.model_loader import resolve
from engine.outputs import EngineStats, RequestOutput
from engine.sampling_params import SamplingParams
from engine.tokenizer import load_tokenizer


class LLMEngine:
    """Requests (text or token ids) in, RequestOutputs out, one engine step per step() call."""

    def __init__(self, config: EngineConfig, hooks: Hooks | None = None, multiprocess: bool = False,
                 core_options: dict | None = None):
        self.config = config
        self.hooks = hooks or Hooks()
        options = {"options": core_options or {"trace": hooks is not None}} if multiprocess else {}
        self.engine_core = EngineCoreClient.make_client(multiprocess, False, config, self.hooks, **options)
        if multiprocess:
            ready = self.engine_core.ready
            self.tokenizer = load_tokenizer(resolve(config.model.model))
            self.max_model_len, vocab_size = ready["max_model_len"], ready["vocab_size"]
        else:  # the core's own: loaded once
            core = self.engine_core.engine_core
            self.tokenizer, self.max_model_len = core.tokenizer, core.max_model_len
            vocab_size = core.model_config.vocab_size
        self.input_processor = InputProcessor(self.tokenizer, self.hooks, vocab_size)
        self.output_processor = OutputProcessor(self.tokenizer, self.hooks)

    def get_tokenizer(self):
        return self.tokenizer

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0) -> str:
        """Validate, tokenize and queue a request; returns its id. Raises ValueError (the
        InputProcessor's or the core's) with nothing queued."""
        params = params or SamplingParams()
        request = self.input_processor.process_inputs(request_id, prompt, params, arrival_time, priority)
        parent, requests = fan_out(request)  # n > 1: n children, gathered by the output processor
        try:
            for r in requests:
                self.engine_core.add_request(r)
                self.output_processor.add(r.request_id, r.prompt, r.prompt_token_ids, r.sampling_params, parent)
        except BaseException:
            self.abort_request([request_id])
            raise
        return request_id

    def step(self) -> list[RequestOutput]:
        """One engine step; the RequestOutputs it produced (only finished ones for "final_only")."""
        outputs = self.engine_core.get_output()
        step = outputs.stats["step"] - 1 if outputs.stats else None
        request_outputs, stopped = self.output_processor.process(outputs.outputs, step)
        for request_id, stop in stopped:  # the core cannot see text: it finishes these as stopped when told
            self.engine_core.abort_requests([request_id], "stop", stop)
        return request_outputs

    def abort_request(self, request_ids: list[str]) -> None:
        """Stop requests and free their blocks. Unknown or finished ids are ignored."""
        core_ids = []
        for rid in request_ids:
            parent = self.output_processor.parents.get(rid)
            core_ids += parent.child_ids if parent is not None else [rid]
            self.output_processor.remove(rid)
        self.engine_core.abort_requests(core_ids)

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def stats(self) -> EngineStats:
        """The engine core's counts now: step, waiting, running, free blocks, preemptions, prefix-cache hits."""
        return EngineStats(**self.engine_core.call("stats"))

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache; False (nothing changed) while requests hold blocks."""
        return self.engine_core.call("reset_prefix_cache")

    def start_profile(self) -> dict:
        return self.engine_core.profile(True)

    def stop_profile(self) -> dict:
        return self.engine_core.profile(False)

    def shutdown(self) -> None:
        """Stop the engine core's process, if any, and its tensor-parallel workers. Safe to call twice."""
        self.engine_core.shutdown()
