"""Tokenizer loading and incremental detokenisation.

Any Hugging Face tokenizer directory works (tokenizer.json, or vocab.json + merges.txt).
The built-in model ships a byte-level tokenizer in the same format (see builtin_model).
"""
from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(str(path))


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text without ever splitting a character.

    Decoding token by token breaks multi-byte UTF-8 characters (one emoji can span several
    byte-level tokens) and word-piece spacing, so, like vLLM, we decode a short window of
    recent tokens and only emit text once it no longer ends in the replacement char U+FFFD.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special = skip_special_tokens
        self.ids: list[int] = list(prompt_ids[-6:])  # a little context, for tokenizers that need it
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def add(self, token_id: int) -> str:
        """Append one token; return the newly completed text (possibly empty)."""
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=self.skip_special)
        full = decode(self.ids[self.prefix_offset:], skip_special_tokens=self.skip_special)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            new = full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self.text += new
            return new
        return ""
