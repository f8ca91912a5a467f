"""Lesson 4: the KV cache and why it exists — recompute versus cache, measured."""
import pathlib
import sys
import time
from dataclasses import dataclass

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # `python lessons/NN_x.py` from a checkout

from lessons.cli import main
from lessons.framework import greedy, queue_request, table

TITLE = "The KV cache: recompute versus cache"
SUMMARY = "Generate with and without the KV cache: tokens the model runs (quadratic vs linear), time, same output."
PROMPT_LEN = 64
GEN = 96


def count_model_tokens(engine) -> list[int]:
    """Record how many tokens each step feeds the model (the length of its input_ids)."""
    sizes: list[int] = []
    prepare = engine.engine_core.engine_core.model_runner.prepare_inputs

    def counted(sched):
        inp = prepare(sched)
        sizes.append(len(inp.input_ids))
        return inp

    engine.engine_core.engine_core.model_runner.prepare_inputs = counted
    return sizes


@dataclass
class TwoWays:
    """What generating GEN tokens recorded, recomputing the sequence each token and with the KV cache."""
    recompute_sizes: list[int]  # tokens fed to the model, each step
    recomputed: list[int]  # the tokens generated
    t_recompute: float  # CPU seconds
    cached_sizes: list[int]
    cached: list[int]
    t_cached: float


def run(lesson) -> None:
    lesson.intro(
        "To produce token *t+1* the model needs, in every layer, the keys and values of all tokens "
        "before it. Without a cache it must run the **whole sequence** through the model again for "
        "every new token; with one it runs only the **new** token and reads the rest from memory. You "
        f"will generate {GEN} tokens after a {PROMPT_LEN}-token prompt both ways on the real engine, "
        "count the tokens the model processes, time both, and compare the outputs.")
    llm, _ = lesson.engine(num_kv_blocks=64, enable_prefix_caching=False)
    engine = llm.llm_engine
    sizes = count_model_tokens(engine)
    prompt = [(11 * i + 3) % 250 for i in range(PROMPT_LEN)]
    runs = _generate_both_ways(lesson, engine, sizes, prompt)
    _tokens_fed_to_the_model(lesson, runs)
    _time_both_ways(lesson, runs)
    _what_is_cached_and_what_it_costs(lesson, engine)


def _generate_both_ways(lesson, engine, sizes: list[int], prompt: list[int]) -> TwoWays:
    """Generate GEN tokens by recomputing, then with the cache, timed as CPU time of one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # CPU time of one thread: other programs on this shared machine don't count
    try:
        # Warm up both paths once (first calls allocate and pick kernels).
        engine.add_request("warm", {"prompt_token_ids": prompt}, greedy(4))
        while engine.has_unfinished_requests():
            engine.step()
        sizes.clear()
        recompute_sizes, recomputed, t_recompute = _recompute(lesson, engine, sizes, prompt)
        sizes.clear()
        cached_sizes, cached, t_cached = _cached(lesson, engine, sizes, prompt)
    finally:
        torch.set_num_threads(threads)
    return TwoWays(recompute_sizes, recomputed, t_recompute, cached_sizes, cached, t_cached)


def _recompute(lesson, engine, sizes: list[int], prompt: list[int]) -> tuple[list[int], list[int], float]:
    """Without a cache: every token = a fresh request over the whole sequence."""
    lesson.say(
        "**Recompute.** For each new token we submit the whole sequence so far as a fresh prompt and "
        "take the one token the engine samples (prefix caching is off, so nothing is reused).")
    seq = list(prompt)
    t0 = time.thread_time()
    for i in range(GEN):
        req = queue_request(engine, f"r{i}", {"prompt_token_ids": seq}, greedy(1))
        while engine.has_unfinished_requests():
            engine.step()
        seq.append(req.output_token_ids[0])
    t_recompute = time.thread_time() - t0
    return list(sizes), seq[PROMPT_LEN:], t_recompute


def _cached(lesson, engine, sizes: list[int], prompt: list[int]) -> tuple[list[int], list[int], float]:
    """With the cache: one request, one prefill, then decode steps."""
    lesson.say("**Cached.** One request: a prefill of the prompt, then one token per step.")
    t0 = time.thread_time()
    req = queue_request(engine, "cached", {"prompt_token_ids": prompt}, greedy(GEN))
    while engine.has_unfinished_requests():
        engine.step()
    t_cached = time.thread_time() - t0
    return list(sizes), req.output_token_ids, t_cached


def _tokens_fed_to_the_model(lesson, runs: TwoWays) -> None:
    """Quadratic versus linear: the token positions each way runs through the model."""
    recompute_sizes, cached_sizes = runs.recompute_sizes, runs.cached_sizes
    P, G = PROMPT_LEN, GEN
    lesson.predict(
        f"How many token positions does each way run through the model to generate {G} tokens "
        f"after a {P}-token prompt?",
        f"Recompute: {P} + {P + 1} + … + {P + G - 1} = G·P + G(G−1)/2 = {G * P + G * (G - 1) // 2:,} "
        f"(quadratic in G). Cached: {P} for the prefill, then 1 per step: {P + G - 1} (linear).")
    rows = []
    for g in (1, 8, 32, G):
        rows.append([g, sum(recompute_sizes[:g]), sum(cached_sizes[:g])])
    lesson.show(table(["tokens generated", "model tokens, recompute", "model tokens, cached"], rows,
                      title="tokens fed to the model (each step's input_ids), cumulative"))
    lesson.check(recompute_sizes == [P + i for i in range(G)],
                 f"recompute feeds the model {P}, {P + 1}, … {P + G - 1} tokens: the whole sequence each time")
    lesson.check(cached_sizes == [P] + [1] * (G - 1), f"cached: {P} tokens once, then 1 token per step")
    lesson.check(sum(recompute_sizes) == G * P + G * (G - 1) // 2 and sum(cached_sizes) == P + G - 1,
                 f"{sum(recompute_sizes):,} versus {sum(cached_sizes)} tokens: "
                 f"{sum(recompute_sizes) / sum(cached_sizes):.0f}× more work without the cache")
    lesson.check(runs.recomputed == runs.cached, f"both ways generate the same {G} tokens (greedy)")
    lesson.pause()


def _time_both_ways(lesson, runs: TwoWays) -> None:
    """The measured times, and why their gap is far smaller than the token gap."""
    recompute_sizes, t_recompute = runs.recompute_sizes, runs.t_recompute
    cached_sizes, t_cached = runs.cached_sizes, runs.t_cached
    G = GEN
    lesson.show(table(["way", "model steps", "CPU seconds", "ms per generated token"], [
        ["recompute", len(recompute_sizes), f"{t_recompute:.2f}", f"{t_recompute / G * 1e3:.1f}"],
        ["KV cache", len(cached_sizes), f"{t_cached:.2f}", f"{t_cached / G * 1e3:.1f}"]],
        title="measured (CPU time of one thread)"))
    # Only the direction is asserted: the size of the gap depends on the machine (seen from 1.8x on a slow,
    # busy CPU to over 3x on a quiet one), the direction does not.
    lesson.check(t_recompute > t_cached,
                 f"the cache makes generation faster: {t_recompute / t_cached:.1f}× here")
    lesson.say(
        f"The time gap ({t_recompute / t_cached:.1f}×) is far smaller than the token gap "
        f"({sum(recompute_sizes) / sum(cached_sizes):.0f}×), and it differs from machine to machine: both "
        f"ways take {G} steps, and at this model size each step's fixed cost (Python, scheduling, a few "
        "dozen small PyTorch calls) outweighs the arithmetic, whatever the step's size. That fixed cost is "
        "why serving engines batch many requests into one step. With a bigger model or longer outputs the "
        "gap widens: recompute's work per token grows with the sequence, the cache's stays flat (apart "
        "from attention, which reads every past key either way).")


def _what_is_cached_and_what_it_costs(lesson, engine) -> None:
    cfg = engine.engine_core.engine_core.model_config
    per_token = 2 * cfg.n_layer * cfg.n_embd * 4
    bm = engine.engine_core.engine_core.kv_cache_manager
    kv_per_block = engine.engine_core.engine_core.startup[-1][2]["bytes_per_block"]
    lesson.say(
        "**What is cached, and what it costs.** For every past token and every layer, its key and value "
        "vectors: exactly what later tokens' attention reads. Queries are not cached: a token's query "
        "is used once, in its own step. Per token that is 2 (K, V) × "
        f"{cfg.n_layer} layers × {cfg.n_embd} (heads × head_size) × 4 bytes = **{per_token:,} bytes** here; "
        "for Llama-2-7B in fp16 (32 layers, 4096 wide) it is 2 × 32 × 4096 × 2 bytes = 0.5 MiB per token, "
        "so a 4,096-token request holds 2 GiB: KV-cache memory is what limits how many requests a GPU "
        "can serve at once.")
    lesson.check(per_token * bm.block_size == kv_per_block,
                 f"{per_token:,} bytes per token × {bm.block_size} tokens = the engine's "
                 f"{kv_per_block:,} bytes per block")
    lesson.done(
        "Without a cache, generating G tokens runs G·P + G(G−1)/2 token positions through the model; with "
        "the KV cache, P + G − 1. The output is identical: the cache stores the keys and values a "
        "recomputation would produce. It trades memory (2 × layers × hidden size values per token) "
        "for compute, and that memory is what paged attention manages.")


if __name__ == "__main__":
    sys.exit(main(globals()))
