"""Lesson 12: sampling — temperature, top-k, top-p, min-p, penalties and seeds on a real next-token distribution."""
import math
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # `python lessons/NN_x.py` from a checkout

import torch

from engine import SamplingParams
from engine.request import Request
from engine.sample.sampler import Sampler
from lessons.cli import main
from lessons.framework import queue_request, table

TITLE = "Sampling"
SUMMARY = ("Temperature, top-k, top-p, min-p, repetition and its penalties, and seeds, on the model's real "
           "next-token distribution.")
# The built-in model learned Python's documentation, so the prompts come from there.
PROMPT = "The default value of this argument is"
OFF_DOMAIN = "The capital of France is"
LOOP_PROMPT = "Return a new list"
LOOP_TOKENS = 48
N_DRAWS = 2000
T = 0.7  # the temperature the filters are shown at (sharpens this broad distribution, so the kept sets are short)


def engine_draws(logits: torch.Tensor, n: int, **params) -> list[int]:
    """n draws by the engine's own Sampler from one row of logits: n requests, each with its own seed (a
    request's draw at one position is fixed by its seed)."""
    reqs = []
    for i in range(n):
        r = Request(f"draw-{i}", None, [0], SamplingParams(seed=i, **params), None, 1)
        r.sampling_seed = i
        reqs.append(r)
    return Sampler()(logits.expand(n, -1).clone(), reqs).token_ids


def draw_at_position(logits: torch.Tensor, seed: int, position: int) -> int:
    """The engine's Sampler's draw for a request with this seed whose next token is at `position`."""
    r = Request("at-position", None, [0] * position, SamplingParams(temperature=1.0), None, 1)
    r.sampling_seed = seed
    return Sampler()(logits[None].clone(), [r]).token_ids[0]


def piece(tok, t: int) -> str:
    return repr(tok.decode([t]))


def probs_at(logits: torch.Tensor, temp: float) -> torch.Tensor:
    return torch.softmax(logits / temp, dim=-1)


def run(lesson) -> None:
    lesson.intro(
        "After each step the model gives, for every request, one **logit** per vocabulary entry. The "
        "sampler turns them into the next token. Greedy decoding takes the largest; sampling draws from "
        "`softmax(logits / temperature)`, usually after cutting the unlikely tail with **top-k**, "
        "**top-p** or **min-p**. You will capture the real logits the engine computes for one prompt, "
        "apply each transform and look at the probability table, then let the engine's own sampler draw "
        f"{N_DRAWS} tokens to confirm what it keeps. Last, you will see greedy decoding repeat itself and "
        "the penalties that break the loop.")
    llm, _ = lesson.engine()
    engine = llm.llm_engine
    tok = engine.tokenizer
    logits, outs = _capture_logits(engine)
    order = logits.argsort(descending=True).tolist()
    _the_engines_next_token_distribution(lesson, engine, tok, logits, order, outs)
    lesson.pause()
    _temperature(lesson, tok, logits, order)
    lesson.pause()

    pt = probs_at(logits, T)
    lesson.say(f"The filters below are each shown alone, on the distribution at **T = {T}**. Each keeps "
               "some tokens, sets the rest to probability 0 and renormalises. (Combined, they act one after "
               "another, each on what the previous one kept.)")
    _top_k(lesson, tok, logits, order, pt)
    lesson.pause()
    _top_p(lesson, tok, logits, order, pt)
    lesson.pause()
    _min_p(lesson, tok, logits, order, pt)
    lesson.pause()
    _penalties_break_greedy_loops(lesson, engine)
    lesson.pause()
    _seeds(lesson, engine, logits)
    lesson.done("Temperature reshapes the whole distribution (0 means greedy). Top-k keeps the k most likely "
                "tokens, top-p the smallest set whose mass reaches p, min-p those within a factor of the top "
                "token; the rest get probability 0. Greedy decoding falls into loops; penalties push down what "
                "a request has already said. Every request has a seed, and each draw is keyed by (seed, position): "
                "reproducible, and independent of its neighbours in the batch.")


def _capture_logits(engine) -> tuple[torch.Tensor, list]:
    """The logits the model runner hands the sampler for PROMPT's next token, and the probe's last outputs."""
    captured = []
    real_sampler = engine.engine_core.engine_core.model_runner.sampler

    class Capture:  # sees the logits the model runner hands to the sampler; the rest is the sampler's
        def __call__(self, logits, requests):
            captured.append(logits[0].detach().float().clone())
            return real_sampler(logits, requests)

        def __getattr__(self, name):
            return getattr(real_sampler, name)

    engine.engine_core.engine_core.model_runner.sampler = Capture()
    engine.add_request("probe", PROMPT, SamplingParams(temperature=0, max_tokens=1, logprobs=20))
    while engine.has_unfinished_requests():
        outs = engine.step()
    engine.engine_core.engine_core.model_runner.sampler = real_sampler
    return captured[0], outs


def _the_engines_next_token_distribution(lesson, engine, tok, logits, order, outs) -> None:
    """The top of the captured distribution is the engine's own; off its training domain it knows nothing."""
    V = logits.numel()
    p1 = probs_at(logits, 1.0)
    cum = 0.0
    rows = []
    for rank, t in enumerate(order[:8], 1):
        cum += float(p1[t])
        rows.append([rank, t, piece(tok, t), f"{float(logits[t]):.3f}", f"{float(p1[t]):.4f}", f"{cum:.4f}"])
    lesson.show(table(["rank", "token id", "piece", "logit", "p (T=1)", "cumulative"], rows,
                      title=f"next token after {PROMPT!r}: the top 8 of {V}"))
    reported = outs[0].outputs[0].logprobs[0]  # the front end's Logprob objects, decoded
    lsm = torch.log_softmax(logits, -1)
    lesson.check(all(abs(lp.logprob - float(lsm[t])) < 1e-4 for t, lp in reported.items()),
                 "these are the engine's logits: its reported top-20 logprobs equal log_softmax of them")
    lesson.check(outs[0].outputs[0].token_ids == [order[0]],
                 f"temperature 0 is greedy: the engine picked the argmax, token {order[0]} ({piece(tok, order[0])})")
    engine.add_request("france", OFF_DOMAIN, SamplingParams(temperature=0, max_tokens=1, logprobs=20))
    while engine.has_unfinished_requests():
        outs = engine.step()
    off_top = [lp.decoded_token for lp in outs[0].outputs[0].logprobs[0].values()]
    lesson.say(f"The built-in model learned only Python's documentation, so prompts here come from that world. "
               f"Asked {OFF_DOMAIN!r}, its top guesses are {', '.join(map(repr, off_top[:5]))}: a model knows "
               "what its training text says, nothing more.")
    lesson.check(not any("Paris" in p or p.strip() in ("Par", "Pa") for p in off_top),
                 f"'Paris' is not among its 20 most likely next tokens after {OFF_DOMAIN!r}")


def _temperature(lesson, tok, logits, order) -> None:
    """Temperature sharpens or flattens the distribution; how cold is greedy depends on the top logits' gap."""
    V = logits.numel()
    temps = [2.0, 1.0, 0.5, 0.1, 0.05]
    ps = {x: probs_at(logits, x) for x in temps}
    entropy = {x: float(-(ps[x] * ps[x].clamp_min(1e-30).log()).sum()) for x in temps}
    lesson.say("**Temperature** divides the logits before the softmax. Above 1 it flattens the distribution, "
               "below 1 it sharpens it; as it goes to 0, all the probability moves to the argmax.")
    lesson.show(table(["token"] + [f"T={x}" for x in temps],
                      [[piece(tok, t)] + [f"{float(ps[x][t]):.4f}" for x in temps] for t in order[:5]]
                      + [["entropy (nats)"] + [f"{entropy[x]:.3f}" for x in temps]],
                      title="probability of the top 5 tokens at each temperature"))
    tops = [float(ps[x][order[0]]) for x in temps]
    lesson.check(all(a < b for a, b in zip(tops, tops[1:])) and all(
        entropy[a] > entropy[b] for a, b in zip(temps, temps[1:])),
        "the lower the temperature, the higher the top token's probability and the lower the entropy")
    # How cold is cold enough depends on the gap between the two top logits: the top token has
    # p >= 1 / (1 + (V - 1) * exp(-gap / T)), which is >= 0.999 once T <= gap / ln(999 (V - 1)).
    gap = float(logits[order[0]] - logits[order[1]])
    bound = max(gap / math.log(999 * (V - 1)), 1e-6)
    unit = 10 ** math.floor(math.log10(bound))
    t_cold = math.floor(bound / unit) * unit  # the bound, rounded down to one significant digit
    p_cold = float(probs_at(logits, t_cold)[order[0]])
    lesson.say(f"How cold is cold enough depends on how far the top logit is ahead of the second: here by only "
               f"{gap:.3f}, so even at T = {temps[-1]} the top token has just {tops[-1]:.0%} of the probability. "
               f"It needs T = {t_cold:g}: the logits are divided by T, so the gap becomes {gap / t_cold:.0f} and "
               "the runner-up's share falls as exp(-gap / T).")
    cold = engine_draws(logits, 500, temperature=t_cold)
    lesson.check(p_cold > 0.999 and set(cold) == {order[0]},
                 f"at T = {t_cold:g} the top token has p = {p_cold:.6f}, and 500 engine draws all picked it")


def show_kept(lesson, tok, pt, name: str, kept: list[int], draws: list[int], extra: dict | None = None) -> None:
    """The tokens a filter keeps at T, renormalised, beside the share of the engine's draws each got."""
    V = pt.numel()
    mass = float(pt[kept].sum())
    counts = {t: draws.count(t) for t in set(draws)}
    rows = [[piece(tok, t), f"{float(pt[t]):.4f}", f"{float(pt[t]) / mass:.4f}",
             f"{counts.get(t, 0) / len(draws):.4f}"] + ([extra[t]] if extra else []) for t in kept[:12]]
    cols = ["token", f"p (T={T})", "kept, renormalised", f"engine: share of {len(draws)} draws"]
    lesson.show(table(cols + (["why kept"] if extra else []), rows,
                      title=f"{name}: keeps {len(kept)} of {V} tokens ({mass:.1%} of the mass)"))


def _top_k(lesson, tok, logits, order, pt) -> None:
    k = 3
    kept_k = order[:k]
    d = engine_draws(logits, N_DRAWS, temperature=T, top_k=k)
    show_kept(lesson, tok, pt, f"top-k = {k}", kept_k, d)
    lesson.check(set(d) == set(kept_k), f"top-k = {k}: the engine drew exactly the {k} most likely tokens, no others")


def _top_p(lesson, tok, logits, order, pt) -> None:
    top_p = 0.9
    sorted_p = pt[order]
    csum = sorted_p.cumsum(0)
    n_nucleus = int((csum < top_p).sum()) + 1  # the smallest prefix whose mass reaches top_p
    kept_p = order[:n_nucleus]
    d = engine_draws(logits, N_DRAWS, temperature=T, top_p=top_p)
    show_kept(lesson, tok, pt, f"top-p = {top_p}", kept_p, d,
              {t: f"cumulative {float(csum[i]):.3f}" for i, t in enumerate(kept_p)})
    lesson.check(float(csum[n_nucleus - 1]) >= top_p > float(csum[n_nucleus - 2]),
                 f"the nucleus is the smallest set of top tokens whose mass reaches {top_p}: {n_nucleus} tokens "
                 f"({float(csum[n_nucleus - 1]):.3f}; without the last one only {float(csum[n_nucleus - 2]):.3f})")
    likely = [t for t in kept_p if float(pt[t]) / float(csum[n_nucleus - 1]) > 0.005]
    lesson.check(set(d) <= set(kept_p) and set(likely) <= set(d),
                 f"the engine drew only from those {n_nucleus} tokens, and drew each of the {len(likely)} that keep "
                 "more than 0.5 % of the renormalised mass")


def _min_p(lesson, tok, logits, order, pt) -> None:
    min_p = 0.05
    pmax = float(pt.max())
    kept_m = [t for t in order if float(pt[t]) >= min_p * pmax]
    d = engine_draws(logits, N_DRAWS, temperature=T, min_p=min_p)
    show_kept(lesson, tok, pt, f"min-p = {min_p}", kept_m, d,
              {t: f"p/p_max = {float(pt[t]) / pmax:.3f}" for t in kept_m})
    lesson.say(f"**Min-p** scales with the model's confidence: it keeps every token with at least "
               f"{min_p} × the top token's probability ({min_p} × {pmax:.3f} = {min_p * pmax:.4f} here). A "
               "confident model keeps few tokens, an unsure one many.")
    mass_m = float(pt[kept_m].sum())
    likely = [t for t in kept_m if float(pt[t]) / mass_m > 0.005]
    lesson.check(set(d) <= set(kept_m) and set(likely) <= set(d) and float(pt[order[len(kept_m)]]) < min_p * pmax,
                 f"min-p = {min_p}: the engine drew only the {len(kept_m)} tokens at or above the threshold, "
                 f"each of the {len(likely)} that keep more than 0.5 % of the mass among them")


def run_alone(engine, params: SamplingParams, rid: str):
    """The finished CompletionOutput (text and token ids) of one request run alone."""
    engine.add_request(rid, LOOP_PROMPT, params)
    while engine.has_unfinished_requests():
        done = [out.outputs[0] for out in engine.step() if out.finished] or None
    return done[0]


def repeats(ids: list[int], n: int = 4) -> int:
    """Positions where the n tokens starting there already appeared earlier in the output."""
    seen, count = set(), 0
    for i in range(len(ids) - n + 1):
        gram = tuple(ids[i:i + n])
        count += gram in seen
        seen.add(gram)
    return count


def _penalties_break_greedy_loops(lesson, engine) -> None:
    """Greedy decoding repeats itself; repetition and frequency penalties cut the repeats."""
    greedy = run_alone(engine, SamplingParams(temperature=0, max_tokens=LOOP_TOKENS, ignore_eos=True), "greedy")
    lesson.say(f"**Repetition.** Greedy decoding always takes the most likely token. Given {LOOP_PROMPT!r} and "
               f"{LOOP_TOKENS} tokens, it writes:\n\n> {LOOP_PROMPT}{greedy.text}")
    g_rep = repeats(greedy.token_ids)
    lesson.check(g_rep > 0, f"greedy decoding repeats itself: {g_rep} of its {LOOP_TOKENS - 3} 4-token windows "
                            "already appeared earlier in its own output")
    lesson.say("Once a phrase has been written, it becomes the context that makes the same phrase likely again. "
               "The **penalties** push down tokens the request has already used: `repetition_penalty` divides a "
               "seen token's positive logit (multiplies a negative one) by the penalty; `frequency_penalty` "
               "subtracts the penalty × how often the token was generated; `presence_penalty` subtracts it once "
               "if it was generated at all.")
    lesson.predict("Same prompt, still greedy, but with repetition_penalty = 1.3. Does the loop survive?",
                   "No: the penalised text repeats far less. It is still greedy (deterministic); only the logits "
                   "of tokens it has already seen are pushed down.")
    rp = run_alone(engine, SamplingParams(temperature=0, max_tokens=LOOP_TOKENS, ignore_eos=True,
                                          repetition_penalty=1.3), "rep")
    fp = run_alone(engine, SamplingParams(temperature=0, max_tokens=LOOP_TOKENS, ignore_eos=True,
                                          frequency_penalty=1.0), "freq")
    rows = [[name, repeats(r.token_ids), len(set(r.token_ids)), repr(r.text)]
            for name, r in [("none", greedy), ("repetition_penalty 1.3", rp), ("frequency_penalty 1.0", fp)]]
    lesson.show(table(["penalty (greedy)", "repeated 4-token windows", "distinct tokens", "text"], rows,
                      title=f"{LOOP_TOKENS} tokens after {LOOP_PROMPT!r}"))
    lesson.check(repeats(rp.token_ids) < g_rep and repeats(fp.token_ids) < g_rep,
                 "both penalties cut the repeated 4-token windows below greedy's")
    lesson.check(fp.token_ids[0] == greedy.token_ids[0],
                 "with frequency_penalty the first token is greedy's: it counts only generated tokens, and none "
                 "exist yet (repetition_penalty also counts the prompt's, as in vLLM and transformers)")


def _seeds(lesson, engine, logits) -> None:
    """Every request has a seed, and a draw is keyed by (seed, position): the same alone or in a batch."""
    lesson.say("**Seeds.** Every request has a seed: its own `seed`, or one the engine picks when it has none "
               "(the trace's QUEUED event and the request detail show it). The sampler keeps each live request's "
               "settings by **slot** (`SamplingStates`, vLLM 0.33's `worker/gpu/sample/states.py`) and draws by "
               "**Gumbel-max keyed by (seed, position)** (`worker/gpu/sample/gumbel.py`; ours: "
               "`kernels/gumbel_sample.py` and its reference): token = argmax(logits + g), where the noise g of "
               "each vocabulary entry is hashed (MurmurHash3, as vLLM 0.33) from (seed, position, token). "
               "No generator state moves between draws, so a request's token at position t depends on nothing but "
               "its seed, t and its logits: not its batch-mates, not the step, not a preemption. The runner before "
               "it (V1's `GPUModelRunner`) kept a `torch.Generator` only for seeded requests and filled the rest "
               "of the batch's noise from torch's global generator (`random_sample` in "
               "`vllm/v1/sample/ops/topk_topp_sampler.py`): an unseeded request's draw then depended on who else "
               "was in the batch, and a seeded one's on how many draws its generator had made.")
    seeded = SamplingParams(temperature=1.0, max_tokens=12, seed=1234, ignore_eos=True)
    alone = queue_request(engine, "alone", PROMPT, seeded)
    while engine.has_unfinished_requests():
        engine.step()
    others = ["Return a new list", "The module provides", "1 2 3"]
    unseeded = [queue_request(engine, f"other-{i}", text, SamplingParams(temperature=1.0, max_tokens=12,
                                                                         ignore_eos=True))
                for i, text in enumerate(others[:2])]
    crowded = queue_request(engine, "crowded", PROMPT, seeded)
    unseeded.append(queue_request(engine, "other-2", others[2], SamplingParams(temperature=1.0, max_tokens=12,
                                                                               ignore_eos=True)))
    lesson.check(crowded.sampling_seed == 1234 and all(r.sampling_seed is not None for r in unseeded) and
                 len({r.sampling_seed for r in unseeded}) == 3,
                 "every request has a seed: the seeded one its own, each unseeded one a seed the engine drew")
    same = {engine_draws(logits[None], 1, temperature=1.0)[0] for _ in range(5)}
    draw_at = [draw_at_position(logits, 1234, pos) for pos in range(8)]
    lesson.check(len(same) == 1 and len(set(draw_at)) > 1,
                 "one (seed, position) always draws the same token; the same seed at other positions draws others")
    reseeded = queue_request(engine, "seed-99", PROMPT, SamplingParams(temperature=1.0, max_tokens=12, seed=99,
                                                                    ignore_eos=True))
    engine.step()
    first_batch = [r.request_id for r in engine.engine_core.engine_core.scheduler.running]
    while engine.has_unfinished_requests():
        engine.step()
    lesson.show(table(["request", "batch", "seed", "tokens"], [
        ["alone", "by itself", 1234, " ".join(map(str, alone.output_token_ids))],
        ["crowded", "with 4 others, 3rd in line", 1234, " ".join(map(str, crowded.output_token_ids))],
        ["seed-99", "same batch", 99, " ".join(map(str, reseeded.output_token_ids))],
    ], title=f"temperature 1.0, prompt {PROMPT!r}"))
    lesson.check(len(first_batch) == 5 and first_batch[2] == "crowded",
                 "the second run really was one batch of 5, with the seeded request 3rd")
    lesson.check(alone.output_token_ids == crowded.output_token_ids,
                 "same seed, same prompt: the same 12 tokens, alone or in a batch of 5")
    lesson.check(reseeded.output_token_ids != crowded.output_token_ids, "a different seed gives different tokens")
    lesson.say("On a GPU one caveat remains: the logits themselves can differ in the last bits with batch "
               "size, and a draw near a boundary can then flip. The seed fixes the randomness, not the numerics.")


if __name__ == "__main__":
    sys.exit(main(globals()))
