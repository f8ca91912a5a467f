"""Tokenizer loading, chat templates and incremental detokenisation, on the `tokenizers` library alone.

Any Hugging Face tokenizer directory works: ``tokenizer.json`` (what transformers' fast tokenizers
save), or the classic GPT-2 pair ``vocab.json`` + ``merges.txt``. The built-in model ships a
``tokenizer.json`` too (see builtin_model).

Why not transformers' ``AutoTokenizer``: importing it imports torch (transformers' configuration
code needs it), 2.7 s on 2 cores, measured in a bare interpreter, against 0.03 s for `tokenizers`.
The API-server process needs a tokenizer and nothing of torch, so with this module it starts
without torch and ``serve`` is ready sooner. `Tokenizer` keeps the names of the transformers
methods the project uses (``encode``, ``decode``, ``apply_chat_template``, ``eos_token_id`` ...),
with the same results: tests/engine/test_tokenizer.py compares them with transformers' on every
kind of checkpoint we load, and chat templates render in the same Jinja sandbox.
"""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path

from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors
from tokenizers.decoders import DecodeStream

GPT2_EOS = "<|endoftext|>"
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


class TokenizerNotFoundError(ValueError):
    """The checkpoint directory has neither tokenizer.json nor vocab.json + merges.txt."""


class Tokenizer:
    """A byte-level BPE tokenizer with transformers' method names.

    `backend_tokenizer` is the `tokenizers.Tokenizer` doing the work. Special tokens
    (``eos_token`` ...) come from tokenizer_config.json / special_tokens_map.json, else from the
    model's config.json ids, else GPT-2's ``<|endoftext|>`` when the vocabulary has it.
    """

    def __init__(self, backend: BackendTokenizer, special_tokens: dict[str, str | None] | None = None,
                 chat_template: str | None = None, model_max_length: int | None = None, name_or_path: str = ""):
        self.backend_tokenizer = backend
        self.special_tokens_map = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        self.chat_template = chat_template
        self.model_max_length = model_max_length
        self.name_or_path = name_or_path

    def __len__(self) -> int:
        """The vocabulary with the added tokens, as transformers' ``len(tokenizer)``."""
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def __repr__(self) -> str:
        return f"Tokenizer({self.name_or_path!r}, vocab={len(self)}, eos={self.eos_token!r})"

    # special tokens, as attributes the way transformers names them
    @property
    def eos_token(self) -> str | None:
        return self.special_tokens_map.get("eos_token")

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens_map.get("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._id_of(self.eos_token)

    @property
    def bos_token_id(self) -> int | None:
        return self._id_of(self.bos_token)

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self.backend_tokenizer.token_to_id(token)

    # encode / decode
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int] | int, skip_special_tokens: bool = False) -> str:
        """Text of the ids. No "clean-up" of spaces: transformers skips it for BPE too."""
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        return self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def batch_decode(self, sequences: list[list[int]], skip_special_tokens: bool = False) -> list[str]:
        return self.backend_tokenizer.decode_batch([list(s) for s in sequences],
                                                   skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: list[int] | int) -> list[str] | str:
        """Vocabulary strings of ids (byte-level: a leading space shows as ``Ġ``)."""
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        return [self.backend_tokenizer.id_to_token(i) for i in ids]

    def convert_tokens_to_ids(self, tokens: list[str] | str) -> list[int | None] | int | None:
        if isinstance(tokens, str):
            return self.backend_tokenizer.token_to_id(tokens)
        return [self.backend_tokenizer.token_to_id(t) for t in tokens]

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    # chat
    def apply_chat_template(self, messages: list[dict], chat_template: str | None = None, tokenize: bool = True,
                            add_generation_prompt: bool = False, **kwargs) -> str | list[int]:
        """Render `messages` with a Jinja chat template (this tokenizer's own unless given), in the
        sandbox transformers uses; returns the text, or its ids when `tokenize`. A template error
        raises jinja2.TemplateError."""
        template = chat_template or self.chat_template
        if template is None:
            raise ValueError("this tokenizer has no chat template: pass chat_template")
        text = _compiled(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                          **self.special_tokens_map, **kwargs)
        return self.encode(text, add_special_tokens=False) if tokenize else text


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer of a checkpoint directory. Raises TokenizerNotFoundError when it has none."""
    path = Path(path)
    config = _read_json(path / "tokenizer_config.json")
    if (path / "tokenizer.json").exists():
        backend = BackendTokenizer.from_file(str(path / "tokenizer.json"))
    elif (path / "vocab.json").exists() and (path / "merges.txt").exists():
        backend = _gpt2_from_vocab_merges(path, config)
    else:
        raise TokenizerNotFoundError(f"{path} has no tokenizer: expected tokenizer.json, or vocab.json and "
                                     "merges.txt (as saved by transformers' save_pretrained)")
    special = _special_tokens(path, config, backend)
    for token in special.values():  # declared special tokens must be matched whole, never split into bytes
        if token is not None and backend.token_to_id(token) is not None:
            backend.add_special_tokens([token])
    template = config.get("chat_template")
    if (path / "chat_template.jinja").exists():  # where transformers 5 saves it
        template = (path / "chat_template.jinja").read_text()
    if isinstance(template, list):  # several named templates: the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return Tokenizer(backend, special, template, config.get("model_max_length"), str(path))


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict."""
    return value.get("content") if isinstance(value, dict) else value


def _special_tokens(path: Path, config: dict, backend: BackendTokenizer) -> dict[str, str | None]:
    declared = _read_json(path / "special_tokens_map.json") | config
    special = {k: _token_text(declared.get(k)) for k in SPECIAL_TOKEN_KEYS if k in declared}
    model_config = _read_json(path / "config.json")
    for key in ("bos_token", "eos_token"):  # not declared: the model's own ids, else GPT-2's defaults
        if key not in special:
            token_id = model_config.get(key + "_id")
            token = backend.id_to_token(token_id) if isinstance(token_id, int) else None
            special[key] = token or (GPT2_EOS if backend.token_to_id(GPT2_EOS) is not None else None)
    return special


def _gpt2_from_vocab_merges(path: Path, config: dict) -> BackendTokenizer:
    """GPT-2's original files as transformers converts them: byte-level BPE, no added prefix space."""
    bpe = models.BPE.from_file(str(path / "vocab.json"), str(path / "merges.txt"))
    tok = BackendTokenizer(bpe)
    add_prefix_space = bool(config.get("add_prefix_space", False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


@lru_cache(maxsize=16)
def _compiled(template: str):
    """A chat template compiled in transformers' sandbox: trim_blocks and lstrip_blocks, loop controls,
    a `tojson` that keeps non-ASCII, `raise_exception` and `strftime_now`; `{% generation %}` blocks
    (assistant masks, which we never ask for) render their body."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text without ever splitting a character.

    Decoding token by token breaks multi-byte UTF-8 characters (one emoji can span several
    byte-level tokens), so a token may complete no text yet. The `tokenizers` library's
    DecodeStream keeps the undecided tokens and returns text only once it is whole.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True):
        self.backend = tokenizer.backend_tokenizer
        # a few prompt tokens as context, for tokenizers whose spacing depends on the left
        self.stream = DecodeStream(ids=list(prompt_ids[-4:]), skip_special_tokens=skip_special_tokens)
        self.text = ""

    def add(self, token_id: int) -> str:
        """Append one token; return the newly completed text (possibly empty)."""
        piece = self.stream.step(self.backend, token_id) or ""
        self.text += piece
        return piece
