"""Lesson 22: speculative decoding — draft cheaply, verify in one pass, keep exactly the target's tokens."""
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # `python lessons/NN_x.py` from a checkout

import torch

from engine import SamplingParams
from engine.outputs import DraftTokenIds
from lessons.cli import main
from lessons.framework import events_of, table

TITLE = "Speculative decoding"
SUMMARY = ("n-gram drafts verified in one pass: why greedy output is identical token for token, what k buys as "
           "acceptance varies, when it costs more than it saves, and where the rejected tokens' KV goes.")
PROMPTS = ["The list of", "Return the", "This function", "If the value is", "The default is", "A new"]


def ngram(k: int) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def timed(llm, prompts, params) -> tuple[float, list]:
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t, outs


def run(lesson) -> None:
    torch.set_num_threads(1)  # small matrices on few cores: steadier timings, the same for every run below
    lesson.intro(
        "A decode step computes one token per request, and on a small batch it is bound by reading the "
        "weights, not by arithmetic: computing 4 tokens of one request costs little more than computing 1. "
        "**Speculative decoding** exploits that: a cheap **proposer** drafts k tokens, the target model "
        "scores all of them in one step (k + 1 query positions, a tiny prefill), and a **rejection "
        "sampler** keeps the drafts the target agrees with. vLLM V1 has several proposers (n-gram, EAGLE, "
        "draft models, MTP: `vllm/v1/spec_decode/`); this engine has two of them. This lesson uses V1's "
        "**n-gram** proposer (prompt lookup, `ngram_proposer.py`): the request's own text is the draft model. "
        "The other, `draft_model.py`, runs a smaller model with the same tokenizer (the built-in "
        "`tiny-gpt2-draft`: `speculative_config={\"method\": \"draft_model\", \"model\": \"tiny-gpt2-draft\", "
        "...}`) in the worker after each step, with its own KV cache over the target's block tables; on a CPU "
        "its passes cost more than its accepted drafts save (`python -m benchmarks.spec_decode` measures both).")
    greedy = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)
    plain, _ = lesson.engine(num_kv_blocks=512)
    spec, session = lesson.engine(num_kv_blocks=512, speculative_config=ngram(4))
    _greedy_output_is_identical(lesson, plain, spec, session, greedy)
    lesson.pause()

    # ---- what k buys ----
    rates = _what_k_buys(lesson, plain, greedy)
    lesson.pause()

    # ---- when it does not pay ----
    vocab = len(plain.get_tokenizer())
    _when_it_does_not_pay(lesson, plain, spec, vocab, rates)
    lesson.pause()

    # ---- where the rejected tokens' KV goes ----
    _rejected_drafts_kv_is_overwritten(lesson, vocab)
    lesson.done(
        "Speculative decoding trades spare compute in memory-bound decode steps for fewer steps: drafts are "
        "verified in one pass and kept only where the target agrees, so greedy output is unchanged and sampled "
        "output keeps the target's distribution. It pays where drafts are right (repetitive text, loops, "
        "code) and costs where they are not; the rejected drafts' slots are just written again.")


def _greedy_output_is_identical(lesson, plain, spec, session, greedy) -> None:
    """The same greedy workload with and without speculation, and one verification from the trace."""
    for llm in (plain, spec):
        llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    t_plain, a = timed(plain, PROMPTS, greedy)
    since = session.bus.next_seq
    t_spec, b = timed(spec, PROMPTS, greedy)
    lesson.check(all(x.outputs[0].token_ids == y.outputs[0].token_ids for x, y in zip(a, b)),
                 f"greedy output is identical token for token with and without speculation ({len(PROMPTS)} "
                 f"requests x {greedy.max_tokens} tokens)")
    lesson.say("Why it must be: a greedy draft is kept only while it *is* the target's argmax at that position "
               "(computed in the same step, from the same cache), and the first disagreement is replaced by the "
               "target's own argmax. Every kept token is one the target would have produced. (For sampling, "
               "V1 keeps draft d with probability min(1, p(d)/q(d)) and on rejection draws from the normalised "
               "(p - q)+: the output is distributed exactly as the target's; `vllm/v1/sample/"
               "rejection_sampler.py`.)")
    events = [e for e in events_of(session) if e.seq >= since and (e.layer, e.name) == ("spec_decode", "verified")]
    ex = next(e for e in events if e.attrs["rejected"] and e.attrs["accepted"])
    lesson.show(table(["step", "request", "drafted", "accepted", "rejected", "then"], [
        [ex.step, ex.request_id, " ".join(map(str, ex.attrs["draft"])), " ".join(map(str, ex.attrs["accepted"])),
         " ".join(map(str, ex.attrs["rejected"])), ex.attrs["token"]]],
        title="one verification, from the trace (spec_decode/verified)"))
    lesson.check(ex.attrs["draft"][:len(ex.attrs["accepted"])] == ex.attrs["accepted"],
                 "the accepted tokens are a prefix of the draft; the rest is rejected and replaced by one token")
    lesson.say(f"The built-in model's greedy text loops (\"{b[0].outputs[0].text[:60].strip()}…\"), so prompt "
               f"lookup finds its drafts: {len(PROMPTS) * greedy.max_tokens} tokens took "
               f"{t_plain * 1000:.0f} ms without speculation and {t_spec * 1000:.0f} ms with k = 4.")


def _what_k_buys(lesson, plain, greedy) -> dict:
    """A sweep of k: acceptance and speed-up against the plain engine; returns the acceptance rate per k."""
    rows, rates = [], {}
    for k in (1, 2, 4, 8):
        llm, _ = lesson.engine(num_kv_blocks=512, speculative_config=ngram(k))
        llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        base, _ = timed(plain, PROMPTS, greedy)  # side by side: this machine's speed drifts between runs
        dt, _ = timed(llm, PROMPTS, greedy)
        st = llm.llm_engine.engine_core.engine_core.stats()
        rates[k] = st.spec_num_accepted_tokens / st.spec_num_draft_tokens
        speedup = base / dt
        rows.append([k, f"{rates[k]:.0%}", f"{st.spec_num_accepted_tokens / st.spec_num_drafts:.2f}",
                     f"{speedup:.2f}x", "█" * round(speedup * 10)])
    lesson.show(table(["k", "acceptance", "accepted per draft", "speed-up", ""], rows,
                      title="a sweep of k on this machine (the same greedy workload)"))
    lesson.check(rates[1] >= rates[8], "acceptance falls as k grows: later draft positions are accepted only "
                                       "if every earlier one was")
    return rates


def _when_it_does_not_pay(lesson, plain, spec, vocab: int, rates: dict) -> None:
    """Sampled text from random prompts: few drafts, fewer accepted."""
    rng = torch.Generator().manual_seed(0)
    random_prompts = [{"prompt_token_ids": torch.randint(5, vocab, (16,), generator=rng).tolist()} for _ in range(6)]
    sampled = SamplingParams(temperature=1.0, seed=0, max_tokens=64, ignore_eos=True)
    t0, _ = timed(plain, random_prompts, sampled)
    before = spec.llm_engine.engine_core.engine_core.stats()
    t1, _ = timed(spec, random_prompts, sampled)
    after = spec.llm_engine.engine_core.engine_core.stats()
    drafted = after.spec_num_draft_tokens - before.spec_num_draft_tokens
    accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    lesson.say(f"**When it does not pay.** Sampled text from random prompts rarely repeats: {drafted} draft tokens "
               f"were proposed for {6 * sampled.max_tokens} output tokens and {accepted} accepted; the run took "
               f"{t1 * 1000:.0f} ms against {t0 * 1000:.0f} ms without speculation. Every rejected draft cost a "
               "verified position. Big batches pay too: they are already compute-bound, so the extra positions "
               "are no longer free.")
    lesson.check(drafted == 0 or accepted / drafted < rates[4],
                 "acceptance is far lower on text that does not repeat than on the greedy loops")


def _rejected_drafts_kv_is_overwritten(lesson, vocab: int) -> None:
    """Three drafts surely rejected: num_computed_tokens moves by one and the next step reuses their slots."""
    llm, _ = lesson.engine(num_kv_blocks=64, block_size=4, speculative_config=ngram(3))
    engine = llm.llm_engine
    core = engine.engine_core.engine_core  # the EngineCore behind the InprocClient
    engine.add_request("r", {"prompt_token_ids": [5, 6, 7, 8] * 3}, SamplingParams(temperature=0, max_tokens=12))
    engine.step()
    req = core.requests["r"]
    n = req.num_tokens
    core.scheduler.update_draft_token_ids(DraftTokenIds(["r"], [[9999 % vocab, 1, 2]]))  # surely rejected
    sched = core.scheduler.schedule()
    slots = [req.block_ids[p // 4] * 4 + p % 4 for p in range(n - 1, n + 3)]
    core.model_executor.execute_model(sched)  # the forward pass, then sample_tokens: the step as EngineCore runs it
    core.scheduler.update_from_output(sched, core.model_executor.sample_tokens(None))
    lesson.check(req.num_computed_tokens == req.num_tokens - 1 == n,
                 f"three drafts rejected: the step computed 4 positions ({n - 1}..{n + 2}), but num_computed_tokens "
                 f"moved by one, to {req.num_computed_tokens}: the rejected drafts' K/V count for nothing")
    nxt = core.scheduler.schedule()
    lesson.check(nxt.num_computed_before()["r"] == n and slots[1] in
                 [req.block_ids[p // 4] * 4 + p % 4 for p in range(n, n + nxt.num_scheduled_tokens["r"])],
                 f"the next step writes position {n} into slot {slots[1]}, where a rejected draft's K/V was: "
                 "nothing is freed or copied, the slot is simply overwritten")


if __name__ == "__main__":
    sys.exit(main(globals()))
