"""Lesson 3: prefill versus decode — many tokens at once versus one, measured."""
import pathlib
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # `python lessons/NN_x.py` from a checkout

from engine import LLM
from lessons.cli import main
from lessons.framework import events_of, greedy, queue_request, table

TITLE = "Prefill versus decode"
SUMMARY = "What a prefill step and a decode step compute, and which is compute-bound or memory-bound, measured."
N = 256  # prompt length of the traced request
PREFILLS = (16, 64, 256)
BATCHES = (1, 8, 32)
ROUNDS = 5  # interleaved rounds: a load spike on the shared CPU hits every configuration alike
DECODE_STEPS = 6  # decode steps timed per round


def largest_cpu_cache() -> int | None:
    """Bytes of this CPU's largest cache level, from Linux's sysfs (None where unavailable)."""
    sizes = []
    for f in pathlib.Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip()
        unit = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        if text.rstrip("KMG").isdigit():
            sizes.append(int(text.rstrip("KMG")) * unit)
    return max(sizes, default=None)


def step_cost(cfg, weight_bytes: int, queries: list[tuple[int, int]]) -> tuple[int, int]:
    """(FLOPs, bytes) of one forward pass over requests given as (new tokens, context after the step).

    Per new token and layer: the linear layers (QKV 3d², output d², MLP 8d²) cost 2·12·d² FLOPs, and
    attention 4·d per key it sees (q·k and p·v). The LM head (2·V·d) runs once per request. Bytes:
    every weight is read once per step, plus each request's K and V for its whole context."""
    d, L = cfg.n_embd, cfg.n_layer
    tokens = sum(q for q, _ in queries)
    keys_seen = sum(sum(ctx - q + i + 1 for i in range(q)) for q, ctx in queries)
    flops = L * (24 * d * d * tokens + 4 * d * keys_seen) + 2 * cfg.vocab_size * d * len(queries)
    kv_bytes = sum(ctx for _, ctx in queries) * 2 * L * d * 4
    return flops, weight_bytes + kv_bytes


def measure(engine, rounds: int) -> tuple[dict[int, float], dict[int, float]]:
    """Median seconds of one prefill step of n tokens, and of one decode step of a batch of b.

    Timed as CPU time of this thread with PyTorch on one thread: on a shared machine, wall time
    also counts the moments other programs hold the CPU (we saw it swing 10x under load)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _measure(engine, rounds)
    finally:
        torch.set_num_threads(threads)


def _measure(engine, rounds: int) -> tuple[dict[int, float], dict[int, float]]:
    clock = time.thread_time
    pre = {n: [] for n in PREFILLS}
    dec = {b: [] for b in BATCHES}
    k = 0
    for _ in range(rounds + 1):  # round 0 warms up, then is thrown away
        for n in PREFILLS:
            k += 1
            engine.add_request(f"p{k}", {"prompt_token_ids": [(7 * i + k) % 250 for i in range(n)]}, greedy(1))
            t = clock()
            engine.step()  # the whole prompt in one step (the request then finishes: max_tokens=1)
            pre[n].append(clock() - t)
        for b in BATCHES:
            for j in range(b):
                k += 1
                engine.add_request(f"d{k}", {"prompt_token_ids": [(3 * i + k) % 250 for i in range(16)]},
                                   greedy(DECODE_STEPS + 1))
            engine.step()  # their prefills
            for _ in range(DECODE_STEPS):
                t = clock()
                engine.step()  # b requests, one new token each
                dec[b].append(clock() - t)
            while engine.has_unfinished_requests():
                engine.step()
    skip_p, skip_d = 1, DECODE_STEPS  # the warm-up round
    return ({n: statistics.median(v[skip_p:]) for n, v in pre.items()},
            {b: statistics.median(v[skip_d:]) for b, v in dec.items()})


def run(lesson) -> None:
    lesson.intro(
        "A request's first step runs its whole prompt through the model at once (**prefill**); every "
        "step after that runs **one** new token (**decode**). vLLM V1 has no separate prefill and decode "
        "phases: each step is one flattened batch, and a request simply contributes many tokens or one. "
        "You will see both kinds of step in the engine's batch, then time them on this machine.")
    llm, session = lesson.engine(num_kv_blocks=64, enable_prefix_caching=False)
    engine = llm.llm_engine
    req = queue_request(engine, "A", {"prompt_token_ids": [(5 * i) % 250 for i in range(N)]}, greedy(3))
    _prefill_feeds_the_whole_prompt(lesson, engine, session, req)
    _decode_feeds_one_token(lesson, engine, session, req)
    cfg, weight_bytes, pre, dec = _prefill_and_decode_timed(lesson)
    _arithmetic_intensity_explains_it(lesson, cfg, weight_bytes)
    _what_this_cpu_shows(lesson, weight_bytes, dec)


def _prefill_feeds_the_whole_prompt(lesson, engine, session, req) -> None:
    engine.step()
    batches = [e for e in events_of(session) if e.layer == "model_runner" and e.name == "batch"]
    pf = batches[-1]
    lesson.show(table(["field", "value"], [
        ["input_ids", f"{len(pf.get('input_ids'))} ids: {pf.get('input_ids')[:6]} …"],
        ["positions", f"{pf.get('positions')[0]} … {pf.get('positions')[-1]}"],
        ["query_start_loc", pf.get("query_start_loc")], ["seq_lens", pf.get("seq_lens")]],
        title=f"step {pf.step}: the prefill of request A ({N}-token prompt)"))
    lesson.check(len(pf.get("input_ids")) == N and pf.get("positions") == list(range(N)),
                 f"the prefill step feeds all {N} prompt tokens, positions 0…{N - 1}, through every layer")
    lesson.check(req.num_output_tokens == 1,
                 "yet it samples one token: only the last position's hidden state becomes logits")


def _decode_feeds_one_token(lesson, engine, session, req) -> None:
    lesson.predict("A now decodes. How many input_ids does the next step feed the model, at what position?",
                   f"One: the token just sampled, at position {N}. Attention reads the other {N} tokens' "
                   "keys and values from the KV cache.")
    engine.step()
    dc = [e for e in events_of(session) if e.layer == "model_runner" and e.name == "batch"][-1]
    lesson.show(table(["field", "value"], [["input_ids", dc.get("input_ids")], ["positions", dc.get("positions")],
                                           ["query_start_loc", dc.get("query_start_loc")],
                                           ["seq_lens", dc.get("seq_lens")]],
                      title=f"step {dc.step}: a decode step of request A"))
    lesson.check(dc.get("input_ids") == [req.output_token_ids[0]] and dc.get("positions") == [N],
                 f"the decode step feeds 1 token (the one sampled last step) at position {N}")
    lesson.check(dc.get("seq_lens") == [N + 1], f"but it attends over all {N + 1} positions (seq_len {N + 1})")
    lesson.pause()


def _prefill_and_decode_timed(lesson):
    """Time prefill and decode steps on an untraced engine. Returns (model config, weight bytes,
    {prefill tokens: seconds}, {decode batch: seconds})."""
    lesson.say(
        f"Now the timings: one prefill step of {', '.join(map(str, PREFILLS))} tokens, and one decode step "
        f"of a batch of {', '.join(map(str, BATCHES))} requests, median of {ROUNDS} interleaved rounds, "
        "on an untraced engine. We time the CPU time of one thread (PyTorch set to one thread): this "
        "machine is shared, and wall-clock times swing up to 10× with other programs' load.")
    lesson.predict(
        "Prefill processes many tokens per step, decode one per request. Which gets more tokens per "
        "second? And if the decode batch grows from 1 to 8 requests, how much longer is a step?",
        "Prefill, by far. A decode step of 8 costs far less than 8 steps of 1: most of its cost is "
        "paid once per step, however many requests share it.")
    plain = LLM(model=lesson.model, num_kv_blocks=256, enable_prefix_caching=False,
                async_scheduling=False).llm_engine
    cfg = plain.engine_core.engine_core.model_config
    weight_bytes = sum(p.numel() * p.element_size() for p in plain.engine_core.engine_core.model.parameters())
    pre, dec = measure(plain, ROUNDS)
    lesson.show(table(["step", "tokens", "ms (median)", "tokens/s", "GFLOP/s achieved", "FLOPs per byte read"],
                      _timing_rows(cfg, weight_bytes, pre, dec), title="measured on this machine"))
    p_tps, d1_tps = N / pre[N], 1 / dec[1]
    lesson.check(p_tps > 5 * d1_tps,
                 f"prefill of {N} runs {p_tps / d1_tps:.0f}× more tokens/s than a single request decoding")
    # (how much it grows depends on the machine: a step's fixed cost, building inputs and launching
    # ops, is a larger share where each op is fast; 16× the tokens measured 3× to 6× the time on CPUs)
    lesson.check(pre[256] > 1.5 * pre[16],
                 f"prefill step time grows with the tokens in it ({pre[16] * 1e3:.1f} → {pre[256] * 1e3:.1f} ms "
                 "for 16× the tokens): there is real work per token, beside a fixed cost per step")
    lesson.check(dec[8] < 3 * dec[1],
                 f"a decode step of 8 requests takes {dec[8] / dec[1]:.1f}× the time of 1 — far from 8×")
    lesson.check(8 / dec[8] > 3 / dec[1], "so batching 8 decodes gives over 3× the decode tokens/s")
    lesson.pause()
    return cfg, weight_bytes, pre, dec


def _timing_rows(cfg, weight_bytes: int, pre: dict[int, float], dec: dict[int, float]) -> list[list]:
    """One row per timed step: tokens, median ms, tokens/s, GFLOP/s achieved, FLOPs per byte read."""
    rows = []
    for n, t in pre.items():
        f, b = step_cost(cfg, weight_bytes, [(n, n)])
        rows.append([f"prefill, 1 × {n}", n, f"{t * 1e3:.2f}", f"{n / t:,.0f}", f"{f / t / 1e9:.2f}", f"{f / b:.1f}"])
    for bsz, t in dec.items():
        f, b = step_cost(cfg, weight_bytes, [(1, 17)] * bsz)
        rows.append([f"decode, {bsz} × 1", bsz, f"{t * 1e3:.2f}", f"{bsz / t:,.0f}", f"{f / t / 1e9:.2f}",
                     f"{f / b:.2f}"])
    return rows


def _arithmetic_intensity_explains_it(lesson, cfg, weight_bytes: int) -> None:
    """FLOPs per byte read: prefill is compute-bound, decode memory-bound."""
    f1, b1 = step_cost(cfg, weight_bytes, [(1, N + 1)])
    fp, bp = step_cost(cfg, weight_bytes, [(N, N)])
    lesson.say(
        "**Why.** Count FLOPs per byte read (*arithmetic intensity*). Every step reads every weight "
        f"once ({weight_bytes / 2**20:.1f} MiB here). A prefill of {N} tokens uses each weight for {N} "
        f"tokens: {fp / 1e6:.0f} MFLOP for {bp / 2**20:.1f} MiB, **{fp / bp:.0f} FLOPs per byte**. One decode "
        f"token uses each weight once: {f1 / 1e6:.1f} MFLOP for {b1 / 2**20:.1f} MiB, **{f1 / b1:.2f} FLOPs "
        "per byte**; a batch of B decodes raises that about B-fold, since the weights are read once for "
        "all of them (each request's own KV cache is still read separately).\n\n"
        "A GPU can do far more arithmetic than it can load bytes: an H100 does ~990 TFLOP/s (bf16) "
        "but reads ~3.35 TB/s of HBM, so a kernel needs ~300 FLOPs per byte to keep its compute busy. "
        "**Prefill** clears that with a few hundred tokens: it is **compute-bound**. **Decode** is far "
        "below it: it is **memory-bound**, limited by streaming weights and KV cache from memory, which "
        "is why serving engines batch many decodes into each step.")
    lesson.check(fp / bp > 50 * (f1 / b1), "prefill's arithmetic intensity is over 50× decode's")


def _what_this_cpu_shows(lesson, weight_bytes: int, dec: dict[int, float]) -> None:
    """On this CPU a decode step's fixed per-step work, not memory bandwidth, is what batching shares."""
    cache = largest_cpu_cache()
    fits = cache is not None and cache > weight_bytes
    lesson.say(
        "**What this CPU shows, honestly.** The shapes above are real, but tiny-gpt2's "
        f"{weight_bytes / 2**20:.1f} MiB of weights "
        + (f"fit in this CPU's {cache / 2**20:.0f} MiB cache, " if fits else "are small, ")
        + "so here a decode step is limited less by memory bandwidth than by fixed per-step work "
        "(Python scheduling, about a hundred small PyTorch calls). Both kinds of cost are paid once per "
        f"step whatever the batch, which is why, measured above on this CPU, a decode step of {BATCHES[-1]} "
        f"requests took {dec[BATCHES[-1]] / dec[1]:.1f}× the time of one ({dec[1] * 1e3:.2f} → "
        f"{dec[BATCHES[-1]] * 1e3:.2f} ms) for {BATCHES[-1]}× the tokens. On a GPU with "
        "a real model (billions of parameters, gigabytes of weights read every step) the shared part is "
        "the weight reads themselves, and the gap between prefill and decode throughput is larger still "
        "(not measured here: this machine has no GPU).")
    lesson.check(dec[BATCHES[-1]] / dec[1] < BATCHES[-1] / 2,
                 f"a decode step of {BATCHES[-1]} costs less than half of {BATCHES[-1]} steps of one")
    if fits:
        lesson.check(fits, f"the weights ({weight_bytes / 2**20:.1f} MiB) fit in the CPU's largest cache")
    lesson.done(
        "Prefill runs a whole prompt in one step: many tokens share each weight read, so it is "
        "compute-bound and has high throughput. Decode runs one token per request per step: each step "
        "re-reads all weights and the KV cache for little arithmetic, so it is memory-bound, and its "
        "step time grows far more slowly than the batch — batching decodes is nearly free throughput.")


if __name__ == "__main__":
    sys.exit(main(globals()))
