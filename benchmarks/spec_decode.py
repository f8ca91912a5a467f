"""Speculative decoding (n-gram proposals, and a draft model) against none, interleaved in one run.

    python -m benchmarks.spec_decode [--model tiny-gpt2] [--requests 16] [--max-tokens 128] [--k 4] [--reps 3]
                                     [--draft-model tiny-gpt2-draft] [--draft-k 3]

Four workloads, each run without speculation, with ``speculative_config={"method": "ngram", ...}``
and with ``{"method": "draft_model", "model": "tiny-gpt2-draft", ...}`` in alternation (the median
of --reps repetitions of each):
  greedy loops   greedy decoding of the built-in model, which falls into loops ("of the list of the
                 list"): prompt lookup finds its drafts in the request's own output;
  sampled        temperature 1.0 on random token prompts: text rarely repeats, so drafts are rare and
                 mostly rejected; this is speculation's cost when it does not pay.
The last two on requests whose target is processed at each verified position:
  penalties      the greedy loops with presence and frequency penalties: each draft position's row is
                 penalised as of that position, so the loops are shorter and drafts fewer;
  json schema    greedy under a JSON schema (structured outputs), prompts with example records: the
                 grammar cuts the drafts it refuses, and masks every verified position.
Prints output tokens/s with and without, their ratio, the acceptance rate (accepted / draft tokens) and the
mean accepted length per draft, and checks that greedy outputs are identical with and without.
The n-gram rows use the engine's default lookup, a 3- to 4-token match (--prompt-lookup-min/max to
try others; SpeculativeConfig's docstring gives what each measured): short matches in text that
does not repeat propose drafts that are mostly rejected, and each costs a verified row. Torch runs
single-threaded by default (--threads): small matrices
on two shared cores measure steadier that way, and both sides get the same.

The draft model costs a forward pass per draft token (a catch-up pass, then k - 1 decode passes);
on a CPU a pass of a 2-layer model is not much cheaper than one of the 4-layer target (both are
mostly per-layer overhead and the 4,096-wide LM head), so it pays only where a GPU makes the
target's pass expensive and the draft's cheap (see benchmarks/RESULTS.md for what it measured).
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from engine import LLM, SamplingParams, StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "n": {"type": "integer"},
                                           "ok": {"type": "boolean"}, "tags": {"type": "array",
                                                                              "items": {"type": "string"}}},
          "required": ["color", "n", "ok", "tags"]}


def run(llm: LLM, prompts, params) -> tuple[float, list[list[int]]]:
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t
    return sum(len(o.outputs[0].token_ids) for o in outs) / dt, [o.outputs[0].token_ids for o in outs]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-gpt2")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads for all")
    ap.add_argument("--prompt-lookup-min", type=int, default=3, help="the n-gram rows' shortest match")
    ap.add_argument("--prompt-lookup-max", type=int, default=4, help="the n-gram rows' longest match")
    ap.add_argument("--draft-model", default="tiny-gpt2-draft", help="the draft_model rows' draft ('' for none)")
    ap.add_argument("--draft-k", type=int, default=3, help="num_speculative_tokens of the draft model")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    specs = {"ngram": {"method": "ngram", "num_speculative_tokens": args.k,
                       "prompt_lookup_max": args.prompt_lookup_max, "prompt_lookup_min": args.prompt_lookup_min}}
    if args.draft_model:
        specs["draft_model"] = {"method": "draft_model", "model": args.draft_model,
                                "num_speculative_tokens": args.draft_k}
    engines = {"none": LLM(args.model, num_kv_blocks=1024)}
    engines |= {name: LLM(args.model, num_kv_blocks=1024, speculative_config=spec) for name, spec in specs.items()}
    tok = engines["none"].get_tokenizer()
    starts = ["The list of", "Return the", "This function", "If the value is", "The default is", "A new",
              "The first argument", "When the file"]
    greedy_prompts = [starts[i % len(starts)] + f" {i}" for i in range(args.requests)]
    rng = random.Random(0)
    sampled_prompts = [{"prompt_token_ids": [rng.randrange(5, len(tok)) for _ in range(16)]}
                       for _ in range(args.requests)]
    json_prompts = [f'Record {i}: {{"color": "red", "n": {i}, "ok": true, "tags": ["a", "b"]}} Record {i + 1}:'
                    for i in range(args.requests)]
    workloads = {
        "greedy loops": (greedy_prompts, SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)),
        "penalties": (greedy_prompts, SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True,
                                                     presence_penalty=0.2, frequency_penalty=0.1)),
        "json schema": (json_prompts, SamplingParams(temperature=0, max_tokens=args.max_tokens, structured_outputs=
                                                     StructuredOutputsParams(json=SCHEMA))),
        "sampled": (sampled_prompts, SamplingParams(temperature=1.0, seed=1, max_tokens=args.max_tokens,
                                                    ignore_eos=True)),
    }
    for llm in engines.values():  # nor is the grammar's compile (one, shared by the json schema requests)
        llm.generate(json_prompts[:1], workloads["json schema"][1], use_tqdm=False)
    for llm in engines.values():  # first-use costs are not the point
        llm.generate(greedy_prompts[:2], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    print(f"model {args.model}, {args.requests} requests x {args.max_tokens} tokens, n-gram k={args.k} "
          f"(match {args.prompt_lookup_min}-{args.prompt_lookup_max} tokens)"
          + (f", draft model {args.draft_model} k={args.draft_k}" if args.draft_model else "")
          + f", {args.threads} torch thread(s), median of {args.reps} interleaved repetitions")
    print(f"{'workload':14s} {'method':12s} {'no spec tok/s':>14s} {'spec tok/s':>11s} {'ratio':>6s} {'accept':>7s} "
          f"{'mean accepted':>14s}  outputs")
    ok = True
    for name, (prompts, params) in workloads.items():
        rates: dict[str, list[float]] = {mode: [] for mode in engines}
        outs = {}
        cores = {mode: engines[mode].llm_engine.engine_core.engine_core for mode in specs}
        before = {mode: core.stats() for mode, core in cores.items()}
        for _ in range(args.reps):
            for mode, llm in engines.items():
                rate, outs[mode] = run(llm, prompts, params)
                rates[mode].append(rate)
        none = statistics.median(rates["none"])
        for mode, core in cores.items():
            after = core.stats()
            drafts = after.spec_num_drafts - before[mode].spec_num_drafts
            draft_tokens = after.spec_num_draft_tokens - before[mode].spec_num_draft_tokens
            accepted = after.spec_num_accepted_tokens - before[mode].spec_num_accepted_tokens
            spec = statistics.median(rates[mode])
            same = outs["none"] == outs[mode]
            if params.temperature == 0:
                ok &= same
            print(f"{name:14s} {mode:12s} {none:14,.0f} {spec:11,.0f} {spec / none:6.2f} "
                  f"{accepted / max(1, draft_tokens):7.0%} {accepted / max(1, drafts):14.2f}  "
                  + ("identical" if same else "differ (sampled: a draft changes which draws are used)"
                     if params.temperature else "DIFFER"))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
