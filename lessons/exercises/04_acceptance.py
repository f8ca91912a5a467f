"""Exercise 4: speculative decoding's acceptance rule (lesson 22).

Graded inside the engine: the rejection sampler's acceptance walk is replaced by the learner's
function for every request that verifies drafts, in an engine running n-gram speculation.
"""
from __future__ import annotations

import torch

import kernels
from engine import LLM, SamplingParams
from lessons.exercises import Grader, greedy, learner_call, run_to_end

TITLE = "The acceptance rule of speculative decoding"
SUMMARY = "which draft tokens the target keeps, and which token follows them"
FUNCTION = "accept_drafts"
SIGNATURE = ("def accept_drafts(drafts: list[int], target_argmax: list[int], target_probs: list[float],\n"
             "                  uniform: list[float], recovered: list[int], bonus: int, greedy: bool) -> list[int]:")
CONTRACT = """
The tokens one request keeps after the target model verified its draft tokens.

drafts: the k proposed tokens, in order. For each draft position j the target computed, from the
same cache in the same step: target_argmax[j], its most likely token; target_probs[j], its
probability p of drafts[j] (after temperature, top-k, top-p); uniform[j], a uniform draw in
[0, 1); recovered[j], a token drawn from the target's distribution with drafts[j] excluded (the
normalised (p - q)+ for an n-gram proposal, whose q is 1 on the draft). bonus: the target's own
token after the last draft.

Walk the drafts in order. Draft j is accepted if greedy and it equals target_argmax[j], or if not
greedy and uniform[j] < target_probs[j] (probability min(1, p / q) with q = 1). At the first
draft that is not accepted, keep the token the target puts there instead (target_argmax[j] when
greedy, recovered[j] otherwise) and stop. If every draft is accepted, the bonus token follows.
Return the accepted drafts followed by that one token: between 1 and k + 1 tokens.
"""
SOLUTION_BODY = """
kept = []
for j, draft in enumerate(drafts):
    accepted = draft == target_argmax[j] if greedy else uniform[j] < target_probs[j]
    if not accepted:
        return kept + [target_argmax[j] if greedy else recovered[j]]
    kept.append(draft)
return kept + [bonus]
"""
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
PROMPTS = [[5, 6, 7, 8] * 4, [11, 12, 13] * 5, [(7 * j + 3) % 250 for j in range(20)]]


def by_hand(fn, g: Grader) -> None:
    call = lambda *a: learner_call(fn, *a)  # noqa: E731
    g.check(call([4, 5, 6], [4, 5, 6], [1.0] * 3, [0.0] * 3, [0] * 3, 9, True) == [4, 5, 6, 9],
            "greedy, all three drafts are the target's argmax: they are kept and the bonus token follows")
    g.check(call([4, 5, 6], [4, 7, 6], [1.0] * 3, [0.0] * 3, [0] * 3, 9, True) == [4, 7],
            "greedy, the second draft disagrees: keep the first, then the target's argmax, and stop")
    g.check(call([4, 5], [1, 2], [0.9, 0.1], [0.5, 0.5], [8, 3], 9, False) == [4, 3],
            "sampled: u = 0.5 < p = 0.9 keeps the first draft; u = 0.5 >= p = 0.1 rejects the second, "
            "replaced by the recovered token")


def statistics(fn, g: Grader) -> None:
    """One draft token (a point mass on token 2) against a target p over 4 tokens, many times: the
    first kept token must be distributed as p, whatever the draft said."""
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([0.1, 0.2, 0.3, 0.4])
    residual = p.clone()
    residual[2] = 0.0
    trials, counts = 4000, [0] * 4
    for u, r in zip(torch.rand(trials, generator=gen).tolist(),
                    torch.multinomial(residual / residual.sum(), trials, replacement=True, generator=gen).tolist()):
        counts[learner_call(fn, [2], [0], [0.3], [u], [r], 0, False)[0]] += 1
    chi2 = sum((c - trials * float(q)) ** 2 / (trials * float(q)) for c, q in zip(counts, p))
    g.check(chi2 < 16.3, f"over {trials} trials the first token is distributed as the target's p = [0.1, 0.2, "
            f"0.3, 0.4] (chi-square {chi2:.1f} < 16.3, 3 degrees of freedom, p = 0.001)", f"counts {counts}")


def in_the_engine(fn, model: str) -> tuple[dict, dict, int]:
    """Run PROMPTS with n-gram speculation, the acceptance walk being fn's (None: the engine's own):
    greedy outputs, seeded sampled outputs, and the number of accepted draft tokens."""
    reference = kernels.rejection_sample_ref

    def walk(draft_token_ids, cu_num_drafts, target_argmax, target_probs, draft_probs, uniform,
             recovered_token_ids, bonus_token_ids, is_greedy, max_drafts):
        out = torch.full((len(bonus_token_ids), max_drafts + 1), -1, dtype=torch.int64)
        cu = cu_num_drafts.tolist()
        for r in range(len(bonus_token_ids)):
            s = slice(cu[r], cu[r + 1])
            kept = learner_call(fn, draft_token_ids[s].tolist(), target_argmax[s].tolist(), target_probs[s].tolist(),
                                uniform[s].tolist(), recovered_token_ids[s].tolist(), int(bonus_token_ids[r]),
                                bool(is_greedy[r]))
            out[r, :len(kept)] = torch.tensor(kept)
        return out

    if fn is not None:
        kernels.rejection_sample_ref = walk  # the engine's rejection sampler looks it up at every step
    try:
        llm = LLM(model, num_kv_blocks=64, speculative_config=NGRAM)
        engine = llm.llm_engine
        for i, p in enumerate(PROMPTS):
            engine.add_request(f"g{i}", {"prompt_token_ids": p}, greedy(32))
        out = run_to_end(engine)
        sampled = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                               SamplingParams(temperature=0.8, seed=5, max_tokens=24, ignore_eos=True), use_tqdm=False)
        return out, {o.request_id: o.outputs[0].token_ids for o in sampled}, \
            engine.engine_core.engine_core.stats().spec_num_accepted_tokens
    finally:
        kernels.rejection_sample_ref = reference


def grade(fn, g: Grader, model: str = "tiny-gpt2") -> None:
    by_hand(fn, g)
    statistics(fn, g)
    g.say("Now inside a real engine running n-gram speculation: every request's drafts go through your function.")
    yours, yours_sampled, accepted = in_the_engine(fn, model)
    plain = LLM(model, num_kv_blocks=64)
    for i, p in enumerate(PROMPTS):
        plain.llm_engine.add_request(f"g{i}", {"prompt_token_ids": p}, greedy(32))
    want = run_to_end(plain.llm_engine)
    g.check(yours == want, "greedy output with your acceptance rule is identical to the engine's without "
                           "speculation, token for token", f"yours {yours}, without speculation {want}")
    _, ref_sampled, ref_accepted = in_the_engine(None, model)
    g.check(accepted == ref_accepted, f"your rule accepted {accepted} draft tokens, exactly as many as the "
                                      f"engine's own ({ref_accepted})")
    g.check(yours_sampled == ref_sampled, "seeded sampled output with your rule equals the engine's own rule's")

