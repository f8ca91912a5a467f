"""DraftModelProposer: a smaller model with the target's tokenizer drafts k tokens (vLLM V1's
``v1/spec_decode/draft_model.py``, shaped as its EAGLE proposer is).

It runs in the worker, right after the target's forward pass, sampling and rejection sampling
of a step (as V1 proposes in its GPU model runner), and its drafts go back to the engine core in
the model output, to ``Scheduler.update_draft_token_ids``. The draft model keeps its own KV cache
(its own layers and heads) over the target's block tables and slot ids: the same number of
blocks of the same size, so a request's block table addresses both caches. The scheduler
allocates k lookahead slots beyond a request's tokens, where the draft writes the keys and values
of its own proposals.

Which of a request's draft-cache positions hold real tokens is tracked per request: ``valid``
(positions 0..valid-1 were computed from the request's tokens) and ``pending`` (the draft tokens
written after them). After verification the accepted drafts were real after all, so ``valid``
grows by the common prefix of ``pending`` and the request's new tokens; rejected positions are
simply rewritten. A request admitted this step (new, or resumed after a preemption, whose blocks
were freed and reallocated, and whose prefix-cache hits may hold draft keys nobody wrote)
starts again from position 0. Each step is one multi-query pass that catches every proposing
request up to its last token (its first draft comes from that pass's last row), then k - 1
single-token passes, batched over the requests, for the other drafts. Drafts are greedy (the
draft's argmax): the rejection sampler treats them as a point mass, which keeps sampled output
distributed as the target's. Measured with tiny-gpt2-draft on tiny-gpt2 (``python -m
benchmarks.spec_decode``, 16 greedy requests, k = 3, 2 CPU cores): 74 % of drafts accepted, yet
0.68-0.73x the tokens/s of no speculation, because a draft pass (1.45 ms) costs half a whole
decode step of the target (2.9 ms): on a CPU both are mostly per-layer overhead.

With tensor parallelism the draft model runs unsharded on rank 0 only: rank 0's model output is
the one the executor keeps (V1's output rank), so only its drafts could ever be used; the other
ranks verify the same drafts when the next step brings them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.config import ConfigError, SpeculativeConfig
from engine.model_executor import model_loader
from engine.sample.sampler import argmax
from engine.worker.model_runner import ModelRunner


def resolve_draft_model(config: SpeculativeConfig, target: model_loader.ModelArchConfig, target_tokenizer,
                        max_model_len: int) -> tuple[Path, model_loader.ModelArchConfig]:
    """The draft checkpoint's directory and config, checked against the target's (on the engine
    core, before any worker starts). Raises one ConfigError that names the fix."""
    from engine.tokenizer import load_tokenizer

    name = config.model
    try:
        path = model_loader.resolve(name)
        model_loader.check_checkpoint(path)
        draft = model_loader.read_config(path)
        tokenizer = load_tokenizer(path)
    except ValueError as e:
        raise ConfigError(f"speculative_config model {name!r}: {e}") from None
    fix = "a draft model must share the target's tokenizer: use a checkpoint trained with it"
    if draft.vocab_size != target.vocab_size:
        raise ConfigError(f"speculative_config model {name!r} has a vocabulary of {draft.vocab_size} tokens, the "
                          f"target {target.vocab_size}; {fix}")
    if tokenizer.get_vocab() != target_tokenizer.get_vocab() or tokenizer.eos_token_id != target_tokenizer.eos_token_id:
        raise ConfigError(f"speculative_config model {name!r} has another tokenizer than the target's; {fix}")
    if draft.max_position_embeddings < max_model_len:
        raise ConfigError(f"speculative_config model {name!r} has {draft.max_position_embeddings} positions, "
                          f"fewer than max_model_len={max_model_len}; set max_model_len <= "
                          f"{draft.max_position_embeddings}")
    return path, draft


@dataclass
class _DraftState:
    valid: int = 0  # draft-cache positions 0..valid-1 hold the request's own tokens
    pending: list[int] = field(default_factory=list)  # draft tokens written at positions valid, valid+1, ...


class DraftModelProposer:
    """Proposes up to k greedy draft tokens per request that decodes next (see the module
    docstring). propose(requests, tables, reset, finished) -> {request id: drafts}, called by the
    model runner after the target's step; it writes the draft model's KV cache and nothing else."""

    def __init__(self, model: torch.nn.Module, kv_caches, block_size: int, device: torch.device, k: int,
                 max_model_len: int):
        self.runner = ModelRunner(model, kv_caches, block_size, device)  # its batch building and forward pass
        self.k, self.block_size, self.max_model_len = k, block_size, max_model_len
        self.states: dict[str, _DraftState] = {}

    @torch.inference_mode()
    def propose(self, requests: list, tables: list[list[int]], reset: set[str],
                finished: set[str]) -> dict[str, list[int]]:
        """requests: those that sampled this step (their tokens include it), with their block tables;
        reset: new or resumed after a preemption (their draft cache is unknown); finished: forgotten."""
        for rid in finished | reset:
            self.states.pop(rid, None)
        # 1. who proposes, and each one's catch-up query (its tokens from the first invalid position)
        reqs, contexts, starts, counts = [], [], [], []
        bs = self.block_size
        for req, table in zip(requests, tables):
            context = req.all_token_ids
            n = len(context)
            room = self.max_model_len - n
            if req.params.max_tokens is not None:
                room = min(room, req.params.max_tokens - (n - req.num_prompt_tokens))
            # the last draft is never written; the others need slots (the scheduler's lookahead)
            count = min(self.k, room - 1, len(table) * bs - n + 1)
            if count <= 0:
                continue
            st = self.states.setdefault(req.request_id, _DraftState())
            valid = st.valid
            for t in st.pending:  # drafts written last time that turned out to be the request's own tokens
                if valid >= n - 1 or context[valid] != t:
                    break
                valid += 1
            st.valid, st.pending = min(valid, n - 1), []  # the last token is always run: its logits give a draft
            reqs.append((req, table))
            contexts.append(context)
            starts.append(st.valid)
            counts.append(count)
        if not reqs:
            return {}
        # 2. one multi-query pass catches every request up to its last token: its first draft
        drafts = [[d] for d in self._pass([c[a:] for c, a in zip(contexts, starts)], starts,
                                          [len(c) for c in contexts], reqs)]
        # 3. k - 1 decode passes, each over the requests that still want a draft
        for j in range(1, max(counts)):
            idx = [r for r, c in enumerate(counts) if c > j]
            nxt = self._pass([[drafts[r][-1]] for r in idx], [len(contexts[r]) + j - 1 for r in idx],
                             [len(contexts[r]) + j for r in idx], [reqs[r] for r in idx])
            for r, d in zip(idx, nxt):
                drafts[r].append(d)
        out = {}
        for (req, _), context, d in zip(reqs, contexts, drafts):
            st = self.states[req.request_id]
            st.valid, st.pending = len(context), d[:-1]  # d[:-1] were written at positions len(context)...
            out[req.request_id] = d
        return out

    def _pass(self, queries: list[list[int]], starts: list[int], seq_lens: list[int], reqs: list) -> list[int]:
        """One forward pass of the draft model: each request's query tokens at positions start..
        seq_len-1 (their keys and values written to the draft cache); the argmax of each last row."""
        bs = self.block_size
        input_ids, positions, slots, qsl, tables = [], [], [], [0], []
        for q, a, (_, table) in zip(queries, starts, reqs):
            input_ids += q
            positions += range(a, a + len(q))
            slots += [table[p // bs] * bs + p % bs for p in range(a, a + len(q))]
            qsl.append(qsl[-1] + len(q))
            tables.append(table)
        inp = self.runner.model_input(input_ids, positions, slots, seq_lens, qsl, tables)
        logits = self.runner.forward(inp)
        ids = argmax(logits.float())
        return [ids] if isinstance(ids, int) else ids
