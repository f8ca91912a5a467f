"""Structured outputs in the engine core (vLLM V1's ``v1/structured_output/``).

A request with ``SamplingParams.structured_outputs`` (a JSON schema, a regex, a list of choices or
an EBNF grammar) goes through four stages, all owned by the StructuredOutputManager beside the
scheduler:

1. ``grammar_init`` (EngineCore.add_request): the grammar is compiled against the model's
   vocabulary on a thread pool, off the engine thread; identical grammars share one compile.
   Meanwhile the request waits as ``WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR`` and the scheduler passes over
   it.
2. ``grammar_bitmask`` (end of Scheduler.schedule): for each scheduled request whose step samples a
   token, its matcher writes which tokens may come next as a bitmask, one bit per token, 32 per
   int32 word: the batch's ``[num_structured, ceil(vocab / 32)]`` array travels with the
   SchedulerOutput to the model runner.
3. The model runner sets every logit the mask forbids to -inf before sampling (kernels/
   apply_token_bitmask.py, or its PyTorch reference), so the sampler can only pick allowed tokens;
   EOS is allowed only where the grammar may end.
4. ``accept_token`` (Scheduler.update_from_output): the matcher advances over the sampled token.

With speculative decoding (V1's design) the grammar also checks the drafts. Scheduler.
update_draft_token_ids cuts a constrained request's drafts to the longest prefix its grammar
accepts (``validate_tokens``: the matcher advances through them and rolls back). The step's bitmask
then has one row per position the model scores for it, draft positions and the bonus position:
row j is the mask after the first j drafts, filled by advancing the matcher through them and
rolling back. Every scored row is masked, so the rejection sampler verifies each draft against
the distribution the request would have sampled from at that position without speculation; after
verification the matcher accepts exactly the kept tokens (step 4). Greedy output is therefore the
same token for token with and without speculation.

A preempted request keeps its matcher: recomputing its KV cache changes nothing about the text
it has written, so the next mask comes from the same state.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures

from engine.structured_output.backend_xgrammar import XgrammarBackend, XgrammarGrammar, allowed_token_ids, num_allowed
from engine.structured_output.request import StructuredOutputRequest

log = logging.getLogger(__name__)


class StructuredOutputManager:
    """Compiles grammars (cached by key) and fills each step's bitmask. tokenizer, vocab_size and
    eos_token_id are the model's: a mask has one bit per row of the model's logits."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_id: int | None, max_num_seqs: int,
                 compile_threads: int = 1):
        self.tokenizer, self.vocab_size, self.eos_token_id = tokenizer, vocab_size, eos_token_id
        self.max_num_seqs = max_num_seqs
        self.backend: XgrammarBackend | None = None  # built on the compile thread, at first use
        self._backend_lock = threading.Lock()
        # compiling is CPU-bound: one thread by default, so it never takes both of 2 cores
        self.executor = ThreadPoolExecutor(compile_threads, thread_name_prefix="grammar-compile")
        self._compiled: dict[tuple, Future] = {}  # key -> Future[CompiledGrammar]
        self._bitmask = None  # [rows, words] int32, allocated at first use, grown for draft positions

    # ---- 1. compile -------------------------------------------------------------------------
    def grammar_init(self, request) -> None:
        """Start compiling the request's grammar (or share a compile already made or under way)."""
        so = request.structured_output_request = StructuredOutputRequest(request.params.structured_outputs)
        so.queued_at = time.monotonic()
        future = self._compiled.get(so.key)
        so.cache_hit = future is not None and future.done() and future.exception() is None
        if future is None or (future.done() and future.exception() is not None):
            future = self._compiled[so.key] = self.executor.submit(self._compile, so.params)
        so.compiled = future

    def _compile(self, params):
        t0 = time.perf_counter()
        with self._backend_lock:  # the first compile imports xgrammar and reads the vocabulary
            if self.backend is None:
                self.backend = XgrammarBackend(self.tokenizer, self.vocab_size, self.eos_token_id)
        compiled = self.backend.compile_grammar(params)
        return compiled, time.perf_counter() - t0

    def check_ready(self, request) -> bool:
        """Whether the request's grammar has compiled (its matcher is then made), or failed
        (``structured_output_request.error`` says why). Never blocks."""
        so = request.structured_output_request
        if so.grammar is not None or so.error is not None:
            return True
        if not so.compiled.done():
            return False
        try:
            compiled, seconds = so.compiled.result()
        except Exception as e:
            so.error = f"{so.kind} grammar failed to compile: {e}"
            return True
        so.compile_s = 0.0 if so.cache_hit else seconds
        so.grammar = XgrammarGrammar(compiled, self.vocab_size)
        return True

    # ---- 2. the step's mask -------------------------------------------------------------------
    def wait_for_compile(self, requests, timeout: float) -> None:
        """Block (the GIL released) until one of these requests' grammars has compiled, or timeout:
        while nothing else can run, an engine spinning through empty steps would only slow the
        compile thread down (and fill the trace with empty steps)."""
        wait_futures([r.structured_output_request.compiled for r in requests], timeout, "FIRST_COMPLETED")

    def grammar_bitmask(self, requests: list, spec_token_ids: list[list[int]]):
        """The bitmask rows of `requests` (each with a ready grammar), in order: per request one
        row for each of its drafts (validated) and one after them, row j the mask once the first j
        drafts are accepted. Each matcher is advanced through its drafts to fill them and rolled
        back after: it ends where it started. Under async scheduling a -1 (a placeholder that is no
        draft) ends the constrained drafts: its own row is the mask after the drafts before it (the
        bonus token's), the rows after it allow every token and the model runner verifies no draft
        there (num_acceptable_drafts). Returns
        the rows and how many tokens each allows."""
        num_rows = len(requests) + sum(map(len, spec_token_ids))
        if self._bitmask is None or self._bitmask.shape[0] < num_rows:
            self._bitmask = self.backend.allocate_token_bitmask(max(num_rows, self.max_num_seqs))
        bitmask, row = self._bitmask, 0
        for req, drafts in zip(requests, spec_token_ids):
            grammar = req.structured_output_request.grammar
            start = grammar.num_processed_tokens
            grammar.fill_bitmask(bitmask, row)
            padded = False  # past a placeholder that is no draft (-1): its rows allow every token (V1's)
            for token_id in drafts:
                padded = padded or token_id < 0
                if not padded and not grammar.accept_token(token_id):  # validated drafts only
                    raise ValueError(f"request {req.request_id}: draft token {token_id} was not validated")
                row += 1
                if padded:
                    bitmask[row] = -1
                else:
                    grammar.fill_bitmask(bitmask, row)
            row += 1
            grammar.rollback(grammar.num_processed_tokens - start)
        rows = bitmask[:num_rows].numpy().copy()  # the buffer is refilled next step
        return rows, num_allowed(rows, self.vocab_size)

    def preview(self, bitmask, first_rows: dict[str, int], counts: dict[str, int],
                limit: int = 8) -> dict[str, list[str]]:
        """For the trace: the text of the allowed tokens of each request whose mask (its first
        row) leaves at most `limit` choices (what the grammar expects next: ',' or '}')."""
        out = {}
        for rid, row in first_rows.items():
            if counts[rid] <= limit:
                ids = allowed_token_ids(bitmask[row], self.vocab_size, limit)
                out[rid] = [self.tokenizer.decode([t]) for t in ids]
        return out

    # ---- 4. after sampling ----------------------------------------------------------------------
    def accept_token(self, request, token_id: int) -> bool:
        """Advance the request's matcher over its new token; False if the grammar refuses it
        (only possible if something after the mask changed the token)."""
        ok = request.structured_output_request.grammar.accept_token(token_id)
        if not ok:
            log.warning("request %s: the grammar refused token %d", request.request_id, token_id)
        return ok

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
