"""The xgrammar backend (vLLM V1's ``v1/structured_output/backend_xgrammar.py``): grammars compiled
against the model's vocabulary, one matcher per request, a bitmask of allowed tokens per step.

xgrammar is imported on first use, never at import time: it costs ~2 s on 2 cores, which neither
``serve``'s start nor a request without a grammar should pay. The engine core imports it on its
compile thread (the request waits as WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR meanwhile); the front end
on its first structured request, to check the grammar before queueing it.
"""
from __future__ import annotations

import json
import re

from engine.sampling_params import SamplingParamsError, StructuredOutputsParams


def xgr():
    import xgrammar  # the import is cached by Python after the first call

    return xgrammar


def choice_as_grammar(choice: list[str]) -> str:
    """One of the strings, exactly: an EBNF alternation of JSON-quoted literals (xgrammar reads
    its string escapes as JSON's)."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choice)


def _whitespace_rule(pattern: str) -> tuple[str, str]:
    """(rule name, rules) for the JSON whitespace `pattern`: the regex as an EBNF grammar whose
    rules are renamed so they cannot clash with the schema's."""
    ebnf = str(xgr().Grammar.from_regex(pattern))
    names = re.findall(r"^(\w+) ::=", ebnf, flags=re.M)
    for name in sorted(names, key=len, reverse=True):
        ebnf = re.sub(rf"\b{name}\b", f"ws_{name}", ebnf)
    return "ws_root", ebnf


JSON_WS = "[ \\n\\r\\t]*"  # xgrammar's any-whitespace, as its JSON grammars write it


def build_grammar(params: StructuredOutputsParams):
    """The xgrammar Grammar of `params` (no vocabulary yet). Raises ValueError naming the problem."""
    x, kind = xgr(), params.kind
    try:
        if kind in ("json", "json_object"):
            schema = params.json if kind == "json" else {"type": "object"}
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as e:
                    raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
            if not isinstance(schema, dict):
                raise ValueError("a JSON schema must be an object")
            if params.whitespace_pattern is not None and not params.disable_any_whitespace:
                return _with_whitespace(params.whitespace_pattern, schema)
            # Compact JSON (", " and ": ", no other whitespace) unless whitespace_pattern asks for more.
            # vLLM lets any whitespace through by default; a small model then writes newlines for ever: with
            # the built-in model at temperature 0.8, 0 of 8 schema answers finished within 120 tokens with
            # any whitespace, 14 of 16 without (two prompts, seeds 0-7).
            return x.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
        if kind == "regex":
            return x.Grammar.from_regex(params.regex)
        if kind == "choice":
            return x.Grammar.from_ebnf(choice_as_grammar(params.choice))
        return x.Grammar.from_ebnf(params.grammar)
    except ValueError:
        raise
    except Exception as e:  # xgrammar's parsers raise RuntimeError: "[time] file.cc:N: message"
        raise ValueError(f"{_what(kind)} cannot be compiled: {_message(e)}") from None


def _with_whitespace(pattern: str, schema: dict):
    """The schema's grammar with `pattern` wherever JSON allows whitespace."""
    x = xgr()
    ebnf = str(x.Grammar.from_json_schema(json.dumps(schema), any_whitespace=True))
    try:
        name, rules = _whitespace_rule(pattern)
    except Exception as e:
        raise ValueError(f"whitespace_pattern is not a usable regex: {_message(e)}") from None
    return x.Grammar.from_ebnf(ebnf.replace(JSON_WS, name) + "\n" + rules)


def _what(kind: str) -> str:
    return {"json": "the JSON schema", "json_object": "the JSON object grammar", "regex": "the regex",
            "choice": "the choices", "grammar": "the grammar"}[kind]


def _message(e: Exception) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", text)  # drop xgrammar's "[12:00:00] file.cc:42: " prefix


def validate_structured_output(params: StructuredOutputsParams) -> None:
    """Raise SamplingParamsError (a 400 naming structured_outputs) unless xgrammar can build the
    grammar. Remembers the keys that passed: the same schema is checked once."""
    key = params.key
    if key in _VALID:
        return
    try:
        build_grammar(params)
    except ValueError as e:
        err = SamplingParamsError(f"structured_outputs: {e}")
        err.param = "structured_outputs"
        raise err from None
    if len(_VALID) >= 1024:
        _VALID.clear()
    _VALID.add(key)


_VALID: set[tuple] = set()


def tokenizer_info(tokenizer, vocab_size: int, eos_token_id: int | None):
    """xgrammar's TokenizerInfo from our `tokenizers`-based Tokenizer: each id's vocabulary string
    and how to read it as bytes (byte-level BPE as GPT-2: "Ġ" is a space; byte fallback as
    SentencePiece: "<0x0A>" is a byte and "▁" a space), stopping at EOS."""
    x = xgr()
    vocab = tokenizer.get_vocab()
    encoded = [""] * min(vocab_size, max(vocab.values()) + 1)
    for piece, i in vocab.items():
        if i < len(encoded):
            encoded[i] = piece
    decoder = json.loads(tokenizer.backend_tokenizer.to_str()).get("decoder") or {}
    parts = [decoder, *(decoder.get("decoders") or [])]
    types = {d.get("type") for d in parts}
    add_prefix_space = False
    if "ByteLevel" in types:
        vocab_type = x.VocabType.BYTE_LEVEL
    elif "ByteFallback" in types:
        vocab_type = x.VocabType.BYTE_FALLBACK
        add_prefix_space = any(d.get("type") in ("Metaspace", "Strip") or d.get("pattern", {}).get("String") == "▁"
                               for d in parts)
    else:
        vocab_type = x.VocabType.RAW
    stops = [eos_token_id] if eos_token_id is not None else None
    return x.TokenizerInfo(encoded, vocab_type, vocab_size=vocab_size, stop_token_ids=stops,
                           add_prefix_space=add_prefix_space)


class XgrammarBackend:
    """Compiles grammars against one vocabulary (built on the compile thread, at first use)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_id: int | None):
        x = xgr()
        self.vocab_size = vocab_size
        self.tokenizer_info = tokenizer_info(tokenizer, vocab_size, eos_token_id)
        # one thread: the engine's own threads and the other requests need the CPU too
        self.compiler = x.GrammarCompiler(self.tokenizer_info, max_threads=1, cache_enabled=False)

    def compile_grammar(self, params: StructuredOutputsParams):
        """A CompiledGrammar: the grammar with, per state, which tokens may follow (the slow part)."""
        return self.compiler.compile_grammar(build_grammar(params))

    def allocate_token_bitmask(self, num_rows: int):
        """[num_rows, ceil(vocab / 32)] int32: bit j of word w allows token 32 w + j."""
        return xgr().allocate_token_bitmask(num_rows, self.vocab_size)


class XgrammarGrammar:
    """One request's matcher: where it is in its grammar. accept_token advances it; fill_bitmask
    writes the tokens that may come next; rollback undoes accepted tokens; validate_tokens checks
    draft tokens without moving it. num_processed_tokens counts the tokens it advanced over (none
    past the grammar's end), so a rollback of the difference returns it exactly."""

    def __init__(self, compiled, vocab_size: int):
        self.matcher = xgr().GrammarMatcher(compiled, max_rollback_tokens=-1)
        self.vocab_size = vocab_size
        self.num_processed_tokens = 0

    def accept_token(self, token_id: int) -> bool:
        if self.matcher.is_terminated():
            return True  # past the grammar's end (ignore_eos): nothing left to check
        if not self.matcher.accept_token(token_id):
            return False
        self.num_processed_tokens += 1
        return True

    def validate_tokens(self, tokens: list[int]) -> list[int]:
        """The longest prefix of `tokens` the grammar accepts from here (V1's name). The matcher
        advances through them to check, then rolls back: it is left where it was."""
        start, n = self.num_processed_tokens, 0
        for token_id in tokens:
            if not self.accept_token(token_id):
                break
            n += 1
        self.rollback(self.num_processed_tokens - start)
        return tokens[:n]

    def fill_bitmask(self, bitmask, row: int) -> None:
        if self.matcher.is_terminated():
            bitmask[row].fill_(-1)  # every token: the grammar has nothing more to say
        else:
            self.matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self.matcher.rollback(num_tokens)
        self.num_processed_tokens -= num_tokens

    def reset(self) -> None:
        self.matcher.reset()
        self.num_processed_tokens = 0


def num_allowed(bitmask, vocab_size: int) -> list[int]:
    """Allowed tokens per row of a packed bitmask (a numpy int32 array; bits past the vocabulary
    never count)."""
    import numpy as np

    words = bitmask.view(np.uint32)
    counts = np.bitwise_count(words).sum(axis=1, dtype=np.int64)
    extra = words.shape[1] * 32 - vocab_size
    if extra:  # the last word's bits past the vocabulary
        counts -= np.bitwise_count(words[:, -1] >> np.uint32(32 - extra))
    return counts.tolist()


def allowed_token_ids(bitmask_row, vocab_size: int, limit: int) -> list[int]:
    """The first `limit` token ids a bitmask row allows."""
    import numpy as np

    bits = np.unpackbits(bitmask_row.view(np.uint8), bitorder="little")[:vocab_size]
    return np.flatnonzero(bits)[:limit].tolist()
