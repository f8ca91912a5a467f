"""SamplingParams, as in vLLM: how to pick each next token and when to stop."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

OUTPUT_KINDS = ("cumulative", "final_only")
KINDS = ("json", "json_object", "regex", "choice", "grammar")  # StructuredOutputsParams' constraints


def max_n_sequences() -> int:
    """The most choices one request may ask for: ``n`` fans out into that many engine requests
    (vLLM's ``VLLM_MAX_N_SEQUENCES``, default 16384, read from the environment as vLLM does)."""
    return int(os.environ.get("VLLM_MAX_N_SEQUENCES", "16384"))


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range."""


@dataclass
class StructuredOutputsParams:
    """Constrain the output to a grammar (vLLM's name and fields): exactly one of ``json`` (a JSON
    schema, as a dict or its text), ``json_object`` (any JSON object), ``regex``, ``choice`` (one
    of these strings) or ``grammar`` (EBNF in xgrammar's dialect, GBNF-like). Compiled by the
    engine core's StructuredOutputManager (engine/structured_output/); the front end's InputProcessor
    checks it first, so a bad schema is refused before it is queued.

    JSON is compact by default here (", " and ": ", nothing else between tokens: a small model
    given any whitespace writes newlines for ever, see backend_xgrammar.build_grammar);
    whitespace_pattern: a regex for the whitespace allowed between JSON tokens instead (``[ \n\t]*``
    for any); disable_any_whitespace (vLLM's): compact even if whitespace_pattern is set."""
    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        kinds = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(kinds) != 1:
            got = ", ".join(kinds) or "none"
            raise _error("structured_outputs", "must set exactly one of json, json_object, regex, choice or "
                         f"grammar (got {got})")
        if self.choice is not None and (not isinstance(self.choice, (list, tuple)) or not self.choice
                                        or any(not isinstance(c, str) or not c for c in self.choice)):
            raise _error("structured_outputs.choice", "must be a non-empty list of non-empty strings")
        if self.choice is not None:
            self.choice = list(self.choice)
        for name in ("regex", "grammar", "whitespace_pattern"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or (not value and name != "whitespace_pattern")):
                raise _error(f"structured_outputs.{name}", "must be a non-empty string")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise _error("structured_outputs.json", "must be a JSON schema: an object, or its text")

    @property
    def kind(self) -> str:
        """Which constraint: json, json_object, regex, choice or grammar."""
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> tuple[str, str, str | None]:
        """(kind, spec as text, whitespace): what a compiled grammar is cached by (vLLM V1's
        structured_output_key, with the whitespace option that changes a JSON grammar)."""
        kind = self.kind
        spec: Any = getattr(self, kind)
        if kind == "json_object":
            spec = ""
        elif not isinstance(spec, str):
            spec = json.dumps(spec, sort_keys=True)
        return kind, spec, "" if self.disable_any_whitespace else self.whitespace_pattern


def _error(param: str, msg: str) -> SamplingParamsError:
    err = SamplingParamsError(f"{param} {msg}")
    err.param = param
    return err


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0 in OpenAI-style callers, mapped before) disables
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per generated token (sampled one included)
    prompt_logprobs: int | None = None  # number of top logprobs per prompt token (the prompt's own included)
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (OpenAI's, in [-100, 100])
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    bad_words: list[str] | None = None  # never generated (their last token is banned after the rest of them)
    bad_words_token_ids: list[list[int]] | None = None  # bad_words tokenized (the front end's InputProcessor)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # vLLM's RequestOutputKind: "cumulative" (an output for every step, the server streams
    # these) or "final_only" (only the finished one; LLM.generate asks for this).
    output_kind: str = "cumulative"
    # JSON schema, regex, choice or grammar the output must follow (a dict here becomes the dataclass:
    # what crosses the wire to the engine core and to the workers)
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM's: arguments for extensions, e.g. {"kv_transfer_params": {...}} for a KV connector
    extra_args: dict | None = None
    stop_strs: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.stop_strs = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        self._validate()

    def _validate(self) -> None:
        def bad(param: str, msg: str) -> None:
            err = SamplingParamsError(f"{param} {msg}")
            err.param = param
            raise err

        if not isinstance(self.n, int) or self.n < 1:
            bad("n", f"must be an integer >= 1, got {self.n}")
        if self.n > max_n_sequences():
            bad("n", f"must be at most {max_n_sequences()}, got {self.n}. To increase this limit, set the "
                     f"VLLM_MAX_N_SEQUENCES environment variable")
        if self.temperature < 0:
            bad("temperature", f"must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < -1 or self.top_k == 0:
            bad("top_k", f"must be -1 (disable) or >= 1, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if not -2 <= self.presence_penalty <= 2:
            bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if not -2 <= self.frequency_penalty <= 2:
            bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty <= 0:
            bad("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        if self.max_tokens is not None and self.max_tokens < 1:
            bad("max_tokens", f"must be >= 1, got {self.max_tokens}")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            bad("min_tokens", f"must be in [0, max_tokens], got {self.min_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            bad("logprobs", f"must be in [0, 20], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            bad("prompt_logprobs", f"must be in [0, 20], got {self.prompt_logprobs}")
        if self.logit_bias is not None:
            self.logit_bias = {int(t): float(b) for t, b in self.logit_bias.items()}
            if any(not -100 <= b <= 100 for b in self.logit_bias.values()):
                bad("logit_bias", "values must be in [-100, 100]")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            bad("allowed_token_ids", "must not be empty (nothing could be sampled)")
        if self.bad_words is not None and any(not w.strip() for w in self.bad_words):
            bad("bad_words", "must be non-empty words")
        if any(not s for s in self.stop_strs):
            bad("stop", "strings must be non-empty")
        if self.output_kind not in OUTPUT_KINDS:
            bad("output_kind", f"must be one of {OUTPUT_KINDS}, got {self.output_kind!r}")

