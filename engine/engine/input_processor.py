"""InputProcessor: a prompt becomes an EngineCoreRequest (vLLM 0.33's ``InputProcessor.process_inputs``
in ``v1/engine/input_processor.py``).

Every front end tokenizes here, before the engine core sees the request: the core takes
token ids only. The API server tokenizes a text prompt earlier still, off the event loop
(``engine/renderers/online_renderer.py``, the renderer's part), and hands this class the ids.
"""
from __future__ import annotations

import time
from dataclasses import asdict, replace

from engine.engine.core_types import EngineCoreRequest
from engine.hooks import Hooks
from engine.sampling_params import SamplingParams
from engine.structured_output.backend_xgrammar import validate_structured_output
from engine.trace_names import ENCODE, TOKENIZER


class InputProcessor:
    """Validates and tokenizes prompts. vocab_size: the model's (None until the core said it)."""

    def __init__(self, tokenizer, hooks: Hooks, vocab_size: int | None = None):
        self.tokenizer, self.hooks, self.vocab_size = tokenizer, hooks, vocab_size

    def process_inputs(self, request_id: str, prompt, params: SamplingParams, arrival_time: float | None = None,
                       priority: int = 0) -> EngineCoreRequest:
        """prompt: a string, a list of token ids or {"prompt_token_ids": [...], "prompt"?: text}.
        Raises ValueError, naming what is wrong, before anything is queued."""
        text, ids = self._tokenize(prompt, request_id)
        if not ids:
            raise ValueError("prompt must not be empty")
        vocab = self.vocab_size
        if vocab is not None and any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab - 1}]")
        params = self._logits_processor_params(params)
        if params.structured_outputs is not None:  # a grammar xgrammar cannot build is refused here, not queued
            validate_structured_output(params.structured_outputs)
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        return EngineCoreRequest(request_id, ids, params, arrival_time or time.monotonic(), text, priority)

    def _logits_processor_params(self, params: SamplingParams) -> SamplingParams:
        """Check the token ids that logit_bias and allowed_token_ids name; tokenize bad_words as vLLM V1
        does (the word as given and with a leading space, so it is banned mid-sentence too)."""
        vocab = self.vocab_size
        for name, ids in (("logit_bias", params.logit_bias or ()),
                          ("allowed_token_ids", params.allowed_token_ids or ())):
            if vocab is not None and any(not 0 <= t < vocab for t in ids):
                raise ValueError(f"{name}: token ids must be in [0, {vocab - 1}]")
        if not params.bad_words or params.bad_words_token_ids is not None:
            return params
        seqs: list[list[int]] = []
        for word in params.bad_words:
            plain = self.tokenizer.encode(word.lstrip())
            spaced = self.tokenizer.encode(" " + word.lstrip())
            seqs.append(plain)
            if spaced != plain:
                seqs.append(spaced)
        return replace(params, bad_words_token_ids=seqs)

    def _tokenize(self, prompt, request_id: str) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" not in prompt:
                raise ValueError("a dict prompt must have 'prompt_token_ids'")
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
            if self.hooks.active:
                self._trace_encode(request_id, ids)
            return prompt, ids
        if isinstance(prompt, (list, tuple)):
            return None, list(prompt)
        raise ValueError(f"prompt must be a string, a list of token ids or {{'prompt_token_ids': [...]}}, "
                         f"got {type(prompt).__name__}")

    def _trace_encode(self, request_id: str, ids: list[int]) -> None:
        self.hooks.emit(TOKENIZER, ENCODE, request_id=request_id, token_ids=ids,
                        pieces=[self.tokenizer.decode([t]) for t in ids])


def wire_params(params: SamplingParams) -> dict:
    """SamplingParams as sent to an engine core in another process (what params_from_wire reads)."""
    d = asdict(params)
    d.pop("stop_strs", None)
    return d
