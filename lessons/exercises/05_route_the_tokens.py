"""Exercise 5: route the tokens — top-k routing with renormalisation, and the expert blocks (lesson 27).

Graded by hand first (vLLM's own moe_align_block_size example, a renormalised and a plain top-k,
an expert with no pair and one with exactly a block), then inside the engine: every MoE layer of
the built-in tiny-moe routes its tokens with the learner's function, in place of ``fused_topk``,
and runs its experts over the learner's blocks, in place of ``moe_align_block_size`` (the torch
backend's ``fused_moe_ref`` reads the blocks as the Triton kernel does: one expert a block, the
padding rows skipped), so wrong routing or wrong blocks change the greedy output.
"""
from __future__ import annotations

import importlib

import torch

import engine.model_executor.layers.fused_moe.layer as moe_layer
from engine import LLM
from engine.builtin_model import MOE_NAME
from engine.model_executor.layers.fused_moe.router import fused_topk
from kernels.moe_align_block_size import moe_align_block_size
from lessons.exercises import Grader, greedy, learner_call, run_to_end

TITLE = "Route the tokens"
SUMMARY = "top-k routing with renormalisation, and the expert blocks"
FUNCTION = "route_tokens"
IMPORTS = "import torch"
SIGNATURE = "def route_tokens(router_logits: torch.Tensor, top_k: int, renormalize: bool, block_size: int) -> tuple:"
CONTRACT = """
Route one MoE layer's tokens to their experts, then sort the (token, expert) pairs into the
blocks the grouped GEMM runs over: vLLM's fused_topk, then its moe_align_block_size.

router_logits: [T, E] float, the router's score of each of the E experts for each of T tokens.

1. Routing. probs = softmax(router_logits) over the E experts, in float32. Each token keeps its
   top_k experts, best first: topk_ids [T, top_k] (int64) and topk_weights [T, top_k] (their
   probs). If renormalize (Mixtral always; Qwen3-MoE when its config says norm_topk_prob, as
   tiny-moe's does), divide each token's weights by their sum, so that they add up to 1.
2. Blocks. Number the pairs p = t * top_k + k (token t's k-th expert, topk_ids flattened). For
   each expert e = 0, 1, ..., E - 1 in turn: its pairs in increasing order, padded with the id
   T * top_k (no pair) up to a multiple of block_size; an expert no token chose gets no rows.
   sorted_token_ids: those runs one after another. expert_ids: one per block of block_size
   rows, the expert whose pairs it holds. num_tokens_post_padded: the number of rows (an int).

Return (topk_weights, topk_ids, sorted_token_ids, expert_ids, num_tokens_post_padded); the last
three may be lists or tensors. Example (vLLM's): top_k 3 of 4 experts, block_size 4,
topk_ids = [[2, 3, 0], [1, 2, 0], [1, 3, 0], [1, 2, 3]] ->
sorted_token_ids = [2, 5, 8, 12, 3, 6, 9, 12, 0, 4, 10, 12, 1, 7, 11, 12],
expert_ids = [0, 1, 2, 3], num_tokens_post_padded = 16.
"""
SOLUTION_BODY = """
probs = torch.softmax(router_logits.float(), dim=-1)
topk_weights, topk_ids = probs.topk(top_k, dim=-1)
if renormalize:
    topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
flat, num_pairs = topk_ids.flatten().tolist(), topk_ids.numel()
sorted_token_ids, expert_ids = [], []
for e in range(router_logits.shape[1]):
    pairs = [p for p in range(num_pairs) if flat[p] == e]
    pairs += [num_pairs] * (-len(pairs) % block_size)
    sorted_token_ids += pairs
    expert_ids += [e] * (len(pairs) // block_size)
return topk_weights, topk_ids, sorted_token_ids, expert_ids, len(sorted_token_ids)
"""
BLOCK = 16  # the torch backend's block size (fused_moe_ref's, the Triton kernel's on a CPU)
VLLM_IDS = [[2, 3, 0], [1, 2, 0], [1, 3, 0], [1, 2, 3]]


def engine_routing(logits: torch.Tensor, top_k: int, renormalize: bool, block_size: int):
    """The engine's own: fused_topk, then moe_align_block_size cut to its rows."""
    w, ids = fused_topk(logits, top_k, renormalize)
    s, e, n = moe_align_block_size(ids, block_size, logits.shape[1])
    n = int(n[0])
    return w, ids, s[:n].tolist(), e[:n // block_size].tolist(), n


def as_routing(out) -> tuple:
    """The learner's return value as (weights, ids, rows, experts, num_rows); ValueError if it is not one."""
    if not isinstance(out, (tuple, list)) or len(out) != 5:
        raise ValueError(f"returned {type(out).__name__} {str(out)[:80]}, not a tuple of five")
    w, ids, rows, experts, n = out
    flat = [torch.as_tensor(x).flatten().tolist() for x in (rows, experts)]
    return torch.as_tensor(w).float(), torch.as_tensor(ids).long(), flat[0], flat[1], int(torch.as_tensor(n))


def blocks_difference(got: tuple, want: tuple, num_pairs: int, block_size: int) -> str:
    """The first block that differs, in the learner's terms."""
    rows, experts, n = got[2:]
    if n != want[4]:
        return (f"num_tokens_post_padded is {n}, expected {want[4]}: the sum over experts of their pairs rounded up "
                f"to a multiple of {block_size}")
    for b in range(n // block_size):
        have, need = rows[b * block_size:(b + 1) * block_size], want[2][b * block_size:(b + 1) * block_size]
        e_have = experts[b] if b < len(experts) else None
        if have != need or e_have != want[3][b]:
            return (f"block {b}: got expert {e_have} with rows {have}, expected expert {want[3][b]} with rows {need} "
                    f"(each expert's pairs in order, padded with {num_pairs} = T·top_k to a multiple of {block_size})")
    return ""


def routing_difference(got: tuple, want: tuple, num_pairs: int) -> str:
    """How the learner's routing of one layer's tokens differs from the engine's ("" if it does not)."""
    if got[1].tolist() != want[1].tolist():
        return f"topk_ids {got[1].tolist()[:3]}…, expected {want[1].tolist()[:3]}…"
    if got[0].shape != want[0].shape or not torch.allclose(got[0], want[0], atol=1e-6):
        return f"topk_weights {got[0].tolist()[:2]}…, expected {want[0].tolist()[:2]}…"
    return blocks_difference(got, want, num_pairs, BLOCK)


def logits_for(ids: list[list[int]], num_experts: int) -> torch.Tensor:
    """Router logits whose top-k, best first, are `ids`."""
    out = torch.zeros(len(ids), num_experts)
    for t, row in enumerate(ids):
        for rank, e in enumerate(row):
            out[t, e] = float(len(row) - rank)
    return out


def by_hand(fn, g: Grader) -> None:
    call = lambda logits, k, renorm, bs: as_routing(learner_call(fn, logits.clone(), k, renorm, bs))  # noqa: E731
    try:
        got = call(logits_for(VLLM_IDS, 4), 3, True, 4)
    except ValueError as e:
        g.check(False, "it returns (topk_weights, topk_ids, sorted_token_ids, expert_ids, num_tokens_post_padded)",
                str(e))
    g.check(got[1].tolist() == VLLM_IDS, "vLLM's example: each token's top-3 experts, best first",
            f"topk_ids {got[1].tolist()}, expected {VLLM_IDS}")
    want = engine_routing(logits_for(VLLM_IDS, 4), 3, True, 4)
    g.check(not blocks_difference(got, want, 12, 4), "vLLM's example: sorted_token_ids [2 5 8 12 | 3 6 9 12 | 0 4 10 "
            "12 | 1 7 11 12], expert_ids [0 1 2 3], 16 rows: each expert's pairs padded to a block of 4",
            blocks_difference(got, want, 12, 4))
    logits = torch.randn(5, 8, generator=torch.Generator().manual_seed(0)) * 2
    for renorm in (True, False):
        w, ids = call(logits, 2, renorm, BLOCK)[:2]
        want_w, want_ids = fused_topk(logits, 2, renorm)
        sums = [round(x, 3) for x in w.sum(-1).tolist()]
        g.check(ids.tolist() == want_ids.tolist() and w.shape == want_w.shape and torch.allclose(w, want_w, atol=1e-6),
                "with renormalize, each token's two weights sum to 1 (norm_topk_prob)" if renorm else
                "without renormalize, the weights are the softmax probabilities themselves (they sum to less than 1)",
                f"your weights {[[round(x, 3) for x in r] for r in w.tolist()][:2]}… sum to {sums}; expected "
                f"{[[round(x, 3) for x in r] for r in want_w.tolist()][:2]}…")
    ids = [[0], [0], [3], [1]]  # expert 0: exactly one block of 2; expert 2: no pair
    got, want = call(logits_for(ids, 4), 1, True, 2), engine_routing(logits_for(ids, 4), 1, True, 2)
    g.check(not blocks_difference(got, want, 4, 2), "an expert with exactly block_size pairs gets one block and no "
            "padding; an expert no token chose gets no block", blocks_difference(got, want, 4, 2))
    logits = torch.randn(37, 8, generator=torch.Generator().manual_seed(1))
    got, want = call(logits, 2, True, BLOCK), engine_routing(logits, 2, True, BLOCK)
    g.check(not blocks_difference(got, want, 74, BLOCK), f"37 tokens, top-2 of 8 experts, blocks of {BLOCK}: the "
            "blocks equal the engine's moe_align_block_size", blocks_difference(got, want, 74, BLOCK))


def workload(engine) -> dict[str, list[int]]:
    engine.add_request("A", "Return a new list containing all items from the iterable in ascending order.", greedy(8))
    engine.step()
    engine.add_request("B", "If the file does not exist, an error is raised.", greedy(8))
    engine.add_request("C", "The default value of the argument is", greedy(8))
    return run_to_end(engine)


def in_the_engine(fn, model: str) -> tuple[dict, list, int]:
    """The workload with every MoE layer routed by fn and run over fn's blocks: the outputs, each
    call's difference from the engine's own routing ("" when none), and how many forward passes of
    a layer ran over fn's blocks."""
    engine = LLM(model, num_kv_blocks=64, async_scheduling=False).llm_engine
    align_module = importlib.import_module("kernels.moe_align_block_size")
    topk, align = moe_layer.fused_topk, align_module.moe_align_block_size
    held, diffs, used = {}, [], [0]

    def learners_topk(gating_output, top_k, renormalize):
        got = as_routing(learner_call(fn, gating_output.clone(), top_k, renormalize, BLOCK))
        diffs.append(routing_difference(got, engine_routing(gating_output, top_k, renormalize, BLOCK),
                                        gating_output.shape[0] * top_k))
        ids = got[1]
        held[id(ids)] = (ids, torch.tensor(got[2], dtype=torch.int32), torch.tensor(got[3], dtype=torch.int32),
                         torch.tensor([got[4]], dtype=torch.int32))
        return got[0], ids

    def learners_blocks(topk_ids, block_size, num_experts, expert_map=None):
        mine = held.pop(id(topk_ids), None)
        if mine is None or mine[0] is not topk_ids or block_size != BLOCK or expert_map is not None:
            return align(topk_ids, block_size, num_experts, expert_map)
        used[0] += 1
        return mine[1:]

    moe_layer.fused_topk, align_module.moe_align_block_size = learners_topk, learners_blocks
    try:
        return workload(engine), diffs, used[0]
    finally:
        moe_layer.fused_topk, align_module.moe_align_block_size = topk, align


def grade(fn, g: Grader, model: str = MOE_NAME) -> None:
    by_hand(fn, g)
    g.say(f"Now inside a real engine ({model}): every MoE layer routes with your function and runs over your blocks.")
    yours, diffs, used = in_the_engine(fn, model)
    g.check(bool(diffs) and used == len(diffs), f"your function routed every MoE layer of every step ({len(diffs)} "
            f"calls), and the experts ran over your blocks each time", f"{used} of {len(diffs)} used your blocks")
    bad = next((i for i, d in enumerate(diffs) if d), None)
    g.check(bad is None, "in every call your ids, weights and blocks equal the engine's own fused_topk and "
            "moe_align_block_size", f"call {bad}: {diffs[bad] if bad is not None else ''}")
    want = workload(LLM(model, num_kv_blocks=64, async_scheduling=False).llm_engine)
    wrong = [r for r in want if yours.get(r) != want[r]]
    g.check(not wrong, "A's, B's and C's greedy output is token for token the engine's own",
            f"request(s) {wrong} generated other tokens")
