"""Tensor parallelism: engine step time with one rank and with two, side by side in one run.

    python -m benchmarks.tensor_parallel [--model tiny-gpt2] [--reps 3] [--requests 8]
                                         [--prompt-tokens 64] [--decode-steps 16] [--device cpu]

For each repetition, both engines (TP=1: the model in this process; TP=2: two worker processes)
take the same batch in turn: NUM requests of PROMPT tokens are prefilled (one step, timed) and
then decoded (DECODE steps, each timed). Printed: the median prefill and decode step in ms for
each, their ratio TP=2 / TP=1, and, from a traced TP=2 decode step, how much of rank 0's kernel
time the collectives (all_reduce, all_gather) took.

There is no target on a CPU: two ranks on 2 cores are slower than one (see lesson 18 for why).
On CUDA the comparison needs two GPUs; with fewer it says so and measures TP=1 only.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

from engine import LLM, SamplingParams
from engine.hooks import Hooks
from engine.trace_names import ALL_GATHER, ALL_REDUCE, KERNEL

COLLECTIVES = (ALL_REDUCE, ALL_GATHER)


def time_steps(engine, num_requests: int, prompt_tokens: int, decode_steps: int, tag: str = "r") -> dict:
    """Prefill num_requests prompts (timed as a whole), then time decode_steps steps one by one.
    Returns {"prefill_ms": float, "decode_ms": [float, ...]}. The requests run to their end."""
    params = SamplingParams(temperature=0, max_tokens=decode_steps + 1, ignore_eos=True)
    for i in range(num_requests):
        ids = [(7 * i + j) % 200 + 10 for j in range(prompt_tokens)]
        engine.add_request(f"{tag}{i}", {"prompt_token_ids": ids}, params)
    t0 = time.perf_counter()
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.engine_core.engine_core.requests.values()):
        engine.step()
    prefill_ms = (time.perf_counter() - t0) * 1e3
    decode = []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        decode.append((time.perf_counter() - t0) * 1e3)
    return {"prefill_ms": prefill_ms, "decode_ms": decode}


def collective_share(events: list[tuple], rank: int = 0) -> tuple[float, float]:
    """(collective µs, all kernel µs) of one rank over the given kernel events (hooks tuples)."""
    mine = [e for e in events if e[0] == KERNEL and e[5].get("rank") == rank and e[4] is not None]
    comm = sum(e[5]["duration_ns"] for e in mine if e[1] in COLLECTIVES) / 1e3
    return comm, sum(e[5]["duration_ns"] for e in mine) / 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-gpt2")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    args = ap.parse_args(argv)

    import torch
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    sizes = [1, 2]
    if device == "cuda" and torch.cuda.device_count() < 2:
        print(f"TP=2 needs 2 GPUs; this machine has {torch.cuda.device_count()}: measuring TP=1 only")
        sizes = [1]
    kv = dict(num_kv_blocks=max(64, args.requests * (-(-(args.prompt_tokens + args.decode_steps + 1) // 16) + 1)))
    engines = {tp: LLM(args.model, tensor_parallel_size=tp, device=device, **kv) for tp in sizes}
    results = {tp: {"prefill_ms": [], "decode_ms": []} for tp in sizes}
    for rep in range(args.reps + 1):  # the first round warms up and is not counted
        for tp, llm in engines.items():
            got = time_steps(llm.llm_engine, args.requests, args.prompt_tokens, args.decode_steps, tag=f"{rep}-")
            if rep:
                results[tp]["prefill_ms"].append(got["prefill_ms"])
                results[tp]["decode_ms"] += got["decode_ms"]

    print(f"\n{args.model} on {device}, {args.requests} requests of {args.prompt_tokens} prompt tokens, "
          f"{args.reps} repetitions (median ms)")
    print(f"{'':24}" + "".join(f"{f'TP={tp}':>12}" for tp in sizes) + ("   TP=2 / TP=1" if len(sizes) == 2 else ""))
    for what in ("prefill_ms", "decode_ms"):
        med = {tp: statistics.median(results[tp][what]) for tp in sizes}
        ratio = f"   {med[2] / med[1]:.2f}" if len(sizes) == 2 else ""
        label = "prefill (one step)" if what == "prefill_ms" else "decode step"
        print(f"{label:24}" + "".join(f"{med[tp]:12.2f}" for tp in sizes) + ratio)
    for llm in engines.values():
        llm.shutdown()

    if 2 in sizes:  # where the time goes: one traced TP=2 run
        events, hooks = [], Hooks()
        hooks.subscribe(lambda *e: events.append(e))
        llm = LLM(args.model, tensor_parallel_size=2, device=device, hooks=hooks, **kv)
        time_steps(llm.llm_engine, args.requests, args.prompt_tokens, 4)
        llm.shutdown()
        last = max(e[4] for e in events if e[0] == KERNEL and e[4] is not None)
        comm, total = collective_share([e for e in events if e[4] == last])
        print(f"traced TP=2 decode step, rank 0: collectives {comm:.0f} µs of {total:.0f} µs kernel time "
              f"({comm / total:.0%})")
    print(f"load average {os.getloadavg()[0]:.2f} (other jobs inflate every figure)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
