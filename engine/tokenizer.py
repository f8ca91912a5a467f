"""Tokenizer loading and incremental detokenisation.

Any Hugging Face tokenizer directory works (tokenizer.json, or vocab.json + merges.txt).
The built-in model ships a byte-level tokenizer in the same format (see builtin_model).
"""
from __future__ import annotations

from pathlib import Path

from tokenizers.decoders import DecodeStream
from transformers import AutoTokenizer, PreTrainedTokenizerBase


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(str(path))


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text without ever splitting a character.

    Decoding token by token breaks multi-byte UTF-8 characters (one emoji can span several
    byte-level tokens), so a token may complete no text yet. The `tokenizers` library's
    DecodeStream keeps the undecided tokens and returns text only once it is whole.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_ids: list[int], skip_special_tokens: bool = True):
        self.backend = tokenizer.backend_tokenizer
        # a few prompt tokens as context, for tokenizers whose spacing depends on the left
        self.stream = DecodeStream(ids=list(prompt_ids[-4:]), skip_special_tokens=skip_special_tokens)
        self.text = ""

    def add(self, token_id: int) -> str:
        """Append one token; return the newly completed text (possibly empty)."""
        piece = self.stream.step(self.backend, token_id) or ""
        self.text += piece
        return piece
