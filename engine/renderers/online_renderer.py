"""The API server's renderer, as vLLM 0.33's ``OnlineRenderer`` (``vllm/renderers/online_renderer.py``): prompts
become token ids here, off the engine's path, and the engine gets ``{"prompt_token_ids": ids,
"prompt": text}``.

Why not let the engine tokenize: it did, on the engine thread, before its length check, so
one 10 MiB prompt held every other request for 35 s only to be refused (measured on the
first server). Now:

* A prompt that must be too long is refused before any tokenizing. A token decodes to at
  most ``max_token_chars`` characters (13 for the built-in tokenizer: ``<|endoftext|>``), so
  a text longer than ``(max_model_len - 1) * max_token_chars`` characters has at least
  max_model_len tokens. This holds for tokenizers without a normalizer (GPT-2's family);
  a normalizer may shrink the text first, and then only the exact check after tokenizing
  applies.
* Tokenizing runs on a small thread pool. Hugging Face's Rust tokenizer releases the GIL
  while it encodes (measured: the event loop ran at full speed beside a 1 MB encode), so a
  long prompt delays nobody else's request.
* The exact check (``len(ids) < max_model_len``) follows at once, still in the server.

The ``tokenizer encode`` trace event (ids and each id's text) is emitted here, as the engine
emits it for a text prompt given to ``LLM.generate``.
"""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from engine.hooks import Hooks
from engine.trace_names import ENCODE, TOKENIZER

TOKENIZER_THREADS = 4


class OnlineRenderer:
    """Turns server prompts into engine prompts. ``process`` raises ValueError (a 400) for
    a prompt the engine would refuse for its length, before the engine sees it."""

    def __init__(self, tokenizer, max_model_len: int, hooks: Hooks, threads: int = TOKENIZER_THREADS):
        self.tokenizer, self.max_model_len, self.hooks = tokenizer, max_model_len, hooks
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="tokenizer")
        self.max_prompt_chars: int | None = None  # longer texts are refused untokenized
        self._pieces: dict[int, str] = {}  # token id -> its text, for the trace (see _token_pieces)
        if getattr(getattr(tokenizer, "backend_tokenizer", None), "normalizer", True) is None:
            self._pieces = dict(enumerate(tokenizer.batch_decode([[t] for t in range(len(tokenizer))])))
            self.max_token_chars = max(1, *map(len, self._pieces.values()))
            self.max_prompt_chars = (max_model_len - 1) * self.max_token_chars

    async def process(self, request_id: str, prompt) -> object:
        """A text prompt -> {"prompt_token_ids", "prompt"}; token ids pass as they are."""
        if not isinstance(prompt, str):
            if isinstance(prompt, (list, tuple)):
                self._check_length(len(prompt))
            return prompt
        if self.max_prompt_chars is not None and len(prompt) > self.max_prompt_chars:
            at_least = -(-len(prompt) // self.max_token_chars)
            raise ValueError(f"prompt is {len(prompt):,} characters, so at least {at_least:,} tokens (no token is "
                             f"longer than {self.max_token_chars} characters); max_model_len is {self.max_model_len}")
        ids = await self.run(self._encode, request_id, prompt)
        self._check_length(len(ids))
        return {"prompt_token_ids": ids, "prompt": prompt}

    async def encode(self, text: str) -> list[int]:
        """Token ids of `text`, off the event loop (for /tokenize: no length limit)."""
        return await self.run(self.tokenizer.encode, text)

    async def run(self, fn, *args):
        """`fn(*args)` on the tokenizer threads (chat templates render there too)."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _encode(self, request_id: str, text: str) -> list[int]:
        ids = self.tokenizer.encode(text)
        if self.hooks.active and len(ids) < self.max_model_len:
            self.hooks.emit(TOKENIZER, ENCODE, request_id=request_id, token_ids=ids, pieces=self._token_pieces(ids))
        return ids

    def _token_pieces(self, ids: list[int]) -> list[str]:
        """Each id's text, decoded once per token and remembered: decoding a 64-token prompt's ids one
        by one took ~1 ms of the API server's CPU, as much as the rest of its work for the request."""
        pieces = self._pieces
        new = [t for t in set(ids) if t not in pieces]
        if new:
            pieces.update(zip(new, self.tokenizer.batch_decode([[t] for t in new])))
        return [pieces[t] for t in ids]

    def _check_length(self, n: int) -> None:
        if n >= self.max_model_len:
            raise ValueError(f"prompt is {n} tokens; max_model_len is {self.max_model_len}, so it must be at most "
                             f"{self.max_model_len - 1} tokens to leave room for one generated token")
