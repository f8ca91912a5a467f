"""Exercise 1: compute slot_mapping for a step's flattened batch (lesson 6).

Graded against the slot-mapping kernel's reference (``kernels.compute_slot_mappings_ref``, the
PyTorch twin of ``_compute_slot_mappings_kernel``), then inside the engine: the model runner's
``compute_slot_mappings`` launch is replaced by the learner's function, so every key and value
of the run is written where the learner says, and attention (which finds keys through the block
tables) only gives the right answer if those slots are right.
"""
from __future__ import annotations

import numpy as np
import torch

import kernels
from engine import LLM
from lessons.exercises import Grader, greedy, learner_call, run_to_end

TITLE = "Slot mapping for a batch"
SUMMARY = "slot = block_table[pos // bs] × bs + pos % bs for a batch"
FUNCTION = "slot_mapping"
SIGNATURE = ("def slot_mapping(block_tables: list[list[int]], starts: list[int], num_tokens: list[int],\n"
             "                 block_size: int) -> list[int]:")
CONTRACT = """
The KV-cache slot of every token of one engine step's flattened batch.

Request i of the batch has block table block_tables[i] (logical block j -> physical block id).
This step computes its tokens at positions starts[i], starts[i] + 1, ..., starts[i] + num_tokens[i] - 1.
Return one slot per token (a list of ints), request after request, positions in order:

    slot = block_table[position // block_size] * block_size + position % block_size

The engine writes each token's key and value into that slot of the paged cache, and the
attention of later steps finds them through the block table, so a wrong slot changes the output.
Example: block_tables=[[3, 7]], starts=[14], num_tokens=[3], block_size=16 -> [62, 63, 112].
"""
SOLUTION_BODY = """
slots = []
for table, start, n in zip(block_tables, starts, num_tokens):
    for pos in range(start, start + n):
        slots.append(table[pos // block_size] * block_size + pos % block_size)
return slots
"""
BLOCK = 16
BUDGET = 64  # small, so prompts are chunked and steps mix decodes with prefill chunks


def expected(tables, starts, counts, bs) -> list[int]:
    """The slot-mapping kernel's reference on this batch (each request's table a row of the per-slot tables)."""
    width = max(1, max(map(len, tables)))
    block_tables = torch.tensor([list(t) + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    qsl = torch.tensor(np.concatenate([[0], np.cumsum(counts)]), dtype=torch.int32)
    positions = torch.tensor([p for s, n in zip(starts, counts) for p in range(s, s + n)], dtype=torch.int64)
    slots = torch.empty(len(positions), dtype=torch.int64)
    kernels.compute_slot_mappings_ref(torch.arange(len(tables)), qsl, positions, block_tables, bs, slots)
    return slots.tolist()


def first_difference(got, want, tables, starts, counts, bs) -> str:
    """Which token's slot is wrong, in the learner's terms."""
    if len(got) != len(want):
        return f"returned {len(got)} slots for a batch of {len(want)} tokens"
    row = 0
    for i, (t, s, n) in enumerate(zip(tables, starts, counts)):
        for p in range(s, s + n):
            if got[row] != want[row]:
                return (f"request {i} (block table {t}), position {p}: got slot {got[row]}, expected "
                        f"block_table[{p} // {bs}] × {bs} + {p} % {bs} = {t[p // bs]} × {bs} + {p % bs} = {want[row]}")
            row += 1
    return ""


def call(fn, tables, starts, counts, bs) -> list[int]:
    out = learner_call(fn, [list(t) for t in tables], list(starts), list(counts), bs)
    return list(out) if isinstance(out, (list, tuple)) else out


def workload(engine) -> dict[str, list[int]]:
    """Lesson 6's mixed steps: a decode beside the last chunk of one prompt and the first of another."""
    engine.add_request("A", {"prompt_token_ids": list(range(1, 21))}, greedy(8))
    engine.step()
    engine.add_request("B", {"prompt_token_ids": [(3 * i) % 250 for i in range(100)]}, greedy(6))
    engine.step()
    engine.add_request("C", {"prompt_token_ids": [(7 * i + 1) % 250 for i in range(40)]}, greedy(6))
    return run_to_end(engine)


def learner_launch(fn, steps: list):
    """The compute_slot_mappings launch, made by the learner's function: the kernel's arguments in
    the learner's terms (each request's block table, first position and token count), its slots
    written where the kernel writes them; each step's inputs and answer kept in ``steps``."""
    def compute_slot_mappings(idx_mapping, query_start_loc, positions, block_tables, block_size, slot_mapping):
        qsl, pos = query_start_loc.tolist(), positions.tolist()
        starts, counts = [pos[a] for a in qsl[:-1]], [b - a for a, b in zip(qsl, qsl[1:])]
        tables = [block_tables[s, :pos[end - 1] // block_size + 1].tolist()
                  for s, end in zip(idx_mapping.tolist(), qsl[1:])]
        want = torch.empty_like(slot_mapping)  # what the kernel's reference writes, for the grading
        kernels.compute_slot_mappings_ref(idx_mapping, query_start_loc, positions, block_tables, block_size, want)
        slots = call(fn, tables, starts, counts, block_size)
        steps.append((len(steps), tables, starts, counts, slots, want[:qsl[-1]].tolist()))
        if isinstance(slots, list) and len(slots) == qsl[-1] and all(isinstance(x, int) for x in slots):
            slot_mapping[:len(slots)] = torch.tensor(slots, dtype=torch.int64)
            slot_mapping[len(slots):] = kernels.PAD_SLOT_ID
        else:
            slot_mapping.fill_(kernels.PAD_SLOT_ID)  # nothing usable: no key is written
    return compute_slot_mappings


def grade(fn, g: Grader, model: str = "tiny-gpt2") -> None:
    # ---- a batch by hand first: clearer messages than a wrong generation ----
    tables, starts, counts = [[3, 7], [5], [2, 9, 4]], [14, 0, 20], [3, 16, 1]
    got = call(fn, tables, starts, counts, BLOCK)
    g.check(isinstance(got, list) and all(isinstance(s, int) for s in got),
            "it returns a list of ints", f"got {type(got).__name__}: {str(got)[:120]}")
    want = expected(tables, starts, counts, BLOCK)
    g.check(len(got) == len(want), "one slot per token of the batch (3 + 16 + 1 = 20)",
            f"returned {len(got)} slots")
    g.check(got == want, "every token's slot is block_table[pos // 16] × 16 + pos % 16 of its own request, "
            "as the slot-mapping kernel's reference computes it", first_difference(got, want, tables, starts, counts,
                                                                                   BLOCK))

    # ---- inside the engine ----
    g.say("Now inside a real engine: its model runner's compute_slot_mappings launch is your function.")
    llm = LLM(model, block_size=BLOCK, num_kv_blocks=32, max_num_batched_tokens=BUDGET, enable_prefix_caching=False,
              async_scheduling=False)
    engine = llm.llm_engine
    core = engine.engine_core.engine_core  # the EngineCore behind the InprocClient
    steps = []
    core.model_runner.input_kernels.compute_slot_mappings = learner_launch(fn, steps)
    outputs = workload(engine)
    mixed = [s for s in steps if len(s[1]) > 1 and max(s[3]) > 1]
    g.check(bool(mixed), f"the engine ran {len(steps)} steps with your slots, {len(mixed)} of them mixing "
            "decodes and prefill chunks")
    for step, tables, starts, counts, slots, want in steps:
        if slots != want:
            g.check(False, "in every step, every token's slot is block_table[pos // 16] × 16 + pos % 16, as the "
                    "kernel's reference computes it", f"step {step}: " + first_difference(slots, want, tables, starts,
                                                                                          counts, BLOCK))
    g.check(True, "in every step, every token's slot is block_table[pos // 16] × 16 + pos % 16, as the kernel's "
            "reference computes it")
    g.check(all(len(set(s[4])) == len(s[4]) for s in steps), "no two tokens of a step share a slot")
    written = {slot for s in steps for slot in s[4]}
    k0 = core.kv_caches[0][0]
    filled = set(k0.reshape(-1, k0.shape[2] * k0.shape[3]).abs().sum(1).nonzero().flatten().tolist())
    g.check(filled == written, f"layer 0's key cache holds data in exactly the {len(written)} slots your "
            "slot mappings named", f"{len(filled - written)} other slots hold data, {len(written - filled)} named "
            "ones are empty")
    ref = workload(LLM(model, block_size=BLOCK, num_kv_blocks=32, max_num_batched_tokens=BUDGET,
                       enable_prefix_caching=False, async_scheduling=False).llm_engine)
    bad = [r for r in ref if outputs.get(r) != ref[r]]
    g.check(not bad, "the greedy output of A, B and C is token for token the engine's own",
            f"request(s) {bad} generated other tokens")
