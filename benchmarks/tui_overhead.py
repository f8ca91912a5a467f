"""What the TUI costs the engine: 64 concurrent streaming requests with the TUI refreshing,
against the same requests with no tracer at all (what `serve --no-tui` runs), in one run,
repetitions interleaved.

    python -m benchmarks.tui_overhead [--requests 64] [--reps 5] [--pane requests]

  no-tui   AsyncLLM over the EngineCore on a thread of this process, no tracer attached (serve --no-tui)
  traced   + the TraceSession the TUI needs (bus and step controller, no trace file)
  tui      + the Textual app (headless, 160x48, on the asyncio loop that consumes the streams,
           as serve runs it next to uvicorn) refreshing at REFRESH_HZ, the chosen pane visible

Requests are streamed: each is an async iteration over AsyncLLM.generate, like the
server's SSE handlers. Reported: generated tokens per wall second and per CPU second of the
whole process (all threads), and the TUI's refreshes per second during the run.
Targets: tui / no-tui >= 0.85 (throughput drops at most 15 %); >= 10 refreshes/s.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics

import torch

from benchmarks.workload import make_workload, resolve_model
from engine import LLM, Hooks
from engine.engine.async_llm import AsyncLLM
from tracer.session import TraceSession
from tracer.tui.app import PANES
from tracer.tui.measure import stream_load

MODES = ["no-tui", "traced", "tui"]


async def run_once(mode: str, model: str, workload, pane: str, kv_cache_memory: int | None = None) -> dict:
    hooks = Hooks()
    session = TraceSession(hooks, model=model) if mode != "no-tui" else None
    llm = LLM(model, hooks=hooks, kv_cache_memory=kv_cache_memory)
    ae = AsyncLLM.from_engine_core(llm.llm_engine.engine_core.engine_core, drain_timeout=0).start()
    try:
        r = await stream_load(ae, workload, session, mode == "tui", pane, model=model)
        return {"tokens": r.tokens, "seconds": r.seconds, "cpu": r.cpu, "refresh_hz": r.refresh_hz}
    finally:
        if session is not None:
            session.close()
        ae.stop(drain_timeout=0)


async def main_async(args) -> None:
    workload = make_workload(args.requests, output_len=(args.min_tokens, args.max_tokens))
    # warm-up: model cache, imports, CSS
    await run_once("tui", args.model, make_workload(4), args.pane, args.kv_cache_memory)
    results: dict[str, list[dict]] = {m: [] for m in MODES}
    for rep in range(args.reps):
        order = MODES[rep % len(MODES):] + MODES[:rep % len(MODES)]  # rotate who goes first
        for mode in order:
            r = await run_once(mode, args.model, workload, args.pane, args.kv_cache_memory)
            results[mode].append(r)
            hz = f", {r['refresh_hz']:.1f} refreshes/s" if r["refresh_hz"] is not None else ""
            print(f"rep {rep} {mode:>7}: {r['tokens'] / r['seconds']:8.1f} tokens/s, "
                  f"{r['tokens'] / r['cpu']:8.1f} tokens/CPU-s ({r['tokens']} tokens, {r['seconds']:.2f} s{hz})",
                  flush=True)
    print(f"\nmodel {args.model}, {args.requests} concurrent streaming requests "
          f"({args.min_tokens}-{args.max_tokens} output tokens each), {args.reps} interleaved repetitions, "
          f"{args.threads} torch thread(s), pane '{args.pane}'")
    for label, key in (("tokens/s (wall)", "seconds"), ("tokens/CPU-s", "cpu")):
        rate = {m: [r["tokens"] / r[key] for r in results[m]] for m in MODES}
        print(f"median {label}: " + ", ".join(f"{m} {statistics.median(v):.1f}" for m, v in rate.items()))
        for a in ("traced", "tui"):
            paired = statistics.median(x / y for x, y in zip(rate[a], rate["no-tui"]))
            print(f"  {a} / no-tui (median of per-repetition ratios) = {paired:.3f}"
                  + ("   (target >= 0.85)" if a == "tui" else ""))
    hz = [r["refresh_hz"] for r in results["tui"]]
    print(f"TUI refreshes/s during the runs: median {statistics.median(hz):.1f}, min {min(hz):.1f} (target >= 10)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-gpt2",
                    help="a model name or path; gpt2-shaped: GPT-2 small's size, random weights, built locally")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument(
        "--kv-cache-memory", type=int, default=None, help="bytes for the KV cache (engine default if unset)"
    )
    ap.add_argument("--min-tokens", type=int, default=96, help="output tokens per request, at least")
    ap.add_argument("--max-tokens", type=int, default=160, help="output tokens per request, at most")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--pane", default="requests", choices=[p for p, _ in PANES])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    args.model = resolve_model(args.model)
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
