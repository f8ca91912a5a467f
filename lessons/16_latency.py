"""Lesson 16: latency and its trade-offs — TTFT, ITL/TPOT, E2E and queue time from /metrics and
`vllm-trace bench`; the chunk-size and max_num_seqs sweeps measured here; what only a GPU shows."""
import argparse
import asyncio
import collections
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # `python lessons/NN_x.py` from a checkout

import httpx
import torch
from prometheus_client.parser import text_string_to_metric_families
from rich.text import Text

from engine import LLM
from engine.core.kv_cache_utils import bytes_per_block
from engine.engine.async_llm import AsyncLLM
from engine.entrypoints.openai import build_app
from engine.entrypoints.openai.background import start_background
from lessons.cli import main
from lessons.framework import greedy, queue_request, table
from tracer.commands import bench

TITLE = "Latency and its trade-offs"
SUMMARY = "TTFT, ITL/TPOT, E2E and queue time; chunk size and max_num_seqs trade TTFT against ITL, measured."
BUDGETS = (32, 64, 128, 512)  # max_num_batched_tokens, the chunk size, for the first sweep
SEQS = (2, 4, 12)  # max_num_seqs, for the second


def run(lesson) -> None:
    lesson.intro(
        "Four numbers describe how a request feels. **TTFT** (time to first token): arrival to the first "
        "token, which includes **queue time** (arrival to first scheduled) and the prefill. **ITL** "
        "(inter-token latency): the gap between two tokens of a stream; **TPOT** (time per output token) "
        "averages it per request, (E2E − TTFT) / (tokens − 1). **E2E**: arrival to the last token. You will "
        "read them from a live server's `/metrics` and from `vllm-trace bench`, then sweep the chunk size "
        "(`max_num_batched_tokens`) and `max_num_seqs` to see what one buys at the other's expense.")
    served(lesson)
    lesson.pause()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # thread CPU time then measures the step's own work (see lesson 3)
    try:
        chunk_sweep(lesson)
        lesson.pause()
        seqs_sweep(lesson)
    finally:
        torch.set_num_threads(threads)
    lesson.pause()
    gpu_only(lesson)
    lesson.done(
        "TTFT = queue time + prefill; ITL is the step time a decoding request lives through; E2E = TTFT + "
        "(tokens − 1) × TPOT. A small chunk size keeps every step short (smooth ITL) but spreads a prompt "
        "over many steps (longer TTFT); a large one does the opposite. A small max_num_seqs keeps steps "
        "small but makes requests queue. On a GPU, CUDA graphs and a profiled KV-cache size change the "
        "constants, not the trade-offs.")


# ---- a server, `vllm-trace bench`, /metrics ------------------------------------------------------
def histograms(text: str) -> dict[str, tuple[float, float]]:
    """vllm:*_seconds histogram -> (count, sum), from a Prometheus scrape."""
    out = {}
    for fam in text_string_to_metric_families(text):
        if fam.type == "histogram":
            got = {s.name.rsplit("_", 1)[1]: s.value for s in fam.samples if s.name.endswith(("_count", "_sum"))}
            out[fam.name] = (got.get("count", 0.0), got.get("sum", 0.0))
    return out


def served(lesson) -> None:
    n, prompt_len, out_len = 8, 32, 16
    llm, _ = lesson.engine(num_kv_blocks=64, enable_prefix_caching=False)
    async_engine = AsyncLLM.from_engine_core(llm.llm_engine.engine_core.engine_core)
    server, thread, url = start_background(build_app(async_engine, lesson.model))
    try:
        args = argparse.Namespace(url=url, model=None, num_requests=n, request_rate=float("inf"), concurrency=None,
                                  prompt_len=(prompt_len, prompt_len), output_len=(out_len, out_len), seed=0,
                                  json=None, api_key=None, no_progress=True, duration=None, n=1,
                                  priority=0)
        summary = asyncio.run(bench._run(args))
        with httpx.Client(base_url=url, timeout=30, trust_env=False) as client:
            scrape = client.get("/metrics").text
    finally:
        server.should_exit = True
        thread.join(30)
    h = histograms(scrape)
    server_ms = {k: 1000 * s / c if c else float("nan") for k, (c, s) in h.items()}
    lesson.say(f"`vllm-trace bench`: {n} streamed requests of {prompt_len} prompt and {out_len} output tokens, "
               "all sent at once to a server on a local port. The client times each stream; the server's "
               "`/metrics` histograms time the same requests from inside. As in vLLM, TTFT and E2E run from the "
               "request's `arrival_time`. vLLM 0.33 stamps it in the serving layer's renderer, just before it "
               "tokenizes the prompt (`BaseRenderer.render_cmpl_async`, `vllm/renderers/base.py`); "
               "`InputProcessor.process_inputs` (`vllm/v1/engine/input_processor.py`) only stamps a request that "
               "comes without one. Ours stamps it later, after tokenizing, when the request reaches the engine's "
               "front end (`InputProcessor.process_inputs`, `engine/engine/input_processor.py`), so our TTFT "
               "leaves out the tokenizing that vLLM 0.33's counts. TPOT is exported per "
               "request as `vllm:request_time_per_output_token_seconds` (first to last token over the tokens "
               "after the first; the older `vllm:time_per_output_token_seconds` was per token, what ITL is now). "
               "One difference: vLLM's queue time runs from the core's QUEUED event to its first SCHEDULED "
               "(`IterationStats.update_from_finished_request`, `vllm/v1/metrics/stats.py`); ours runs from "
               "`arrival_time` to the first SCHEDULED, so it also counts the way from the front end into the "
               "scheduler's queue.")
    before = time.monotonic()
    request = llm.llm_engine.input_processor.process_inputs("stamped", "The list type", greedy(1))
    lesson.check(before <= request.arrival_time <= time.monotonic() and request.prompt_token_ids,
                 "our arrival_time is stamped in InputProcessor.process_inputs, the call that takes the prompt (its "
                 "token ids) into the front end")
    rows = [["TTFT", "vllm:time_to_first_token_seconds", summary["ttft"]["mean_ms"],
             server_ms["vllm:time_to_first_token_seconds"]],
            ["ITL", "vllm:inter_token_latency_seconds", summary["itl"]["mean_ms"],
             server_ms["vllm:inter_token_latency_seconds"]],
            ["TPOT", "vllm:request_time_per_output_token_seconds", summary["tpot"]["mean_ms"],
             server_ms["vllm:request_time_per_output_token_seconds"]],
            ["E2E", "vllm:e2e_request_latency_seconds", summary["e2e"]["mean_ms"],
             server_ms["vllm:e2e_request_latency_seconds"]],
            ["queue time", "vllm:request_queue_time_seconds", None, server_ms["vllm:request_queue_time_seconds"]]]
    lesson.show(table(["", "server metric", "bench, client (mean ms)", "/metrics, server (mean ms)"],
                      [[a, b, "—" if c is None else f"{c:.1f}", "—" if d is None else f"{d:.1f}"]
                       for a, b, c, d in rows], title="measured on this machine (shared: times vary run to run)"))
    counts = {k: c for k, (c, _) in h.items()}
    lesson.check(summary["completed"] == n and counts["vllm:time_to_first_token_seconds"] == n
                 and counts["vllm:e2e_request_latency_seconds"] == n and counts["vllm:request_queue_time_seconds"] == n
                 and counts["vllm:request_time_per_output_token_seconds"] == n,
                 f"bench completed {n} requests; the server observed {n} TTFTs, E2Es, queue times and TPOTs "
                 "(one per request)")
    lesson.check(counts["vllm:inter_token_latency_seconds"] == n * (out_len - 1),
                 f"and {n} × ({out_len} − 1) = {n * (out_len - 1)} inter-token gaps: one per token after the first")
    lesson.check(summary["ttft"]["mean_ms"] >= server_ms["vllm:time_to_first_token_seconds"]
                 and summary["e2e"]["mean_ms"] >= server_ms["vllm:e2e_request_latency_seconds"],
                 "the client's TTFT and E2E are the longer: they add HTTP, JSON and tokenizing around the engine's")
    lesson.check(server_ms["vllm:request_queue_time_seconds"] <= server_ms["vllm:time_to_first_token_seconds"],
                 "queue time is part of TTFT")


# ---- the sweeps, on an engine clock ---------------------------------------------------------------
def timeline(model: str, arrivals: list, **engine_kw) -> dict:
    """Run `arrivals` [(step, id, prompt ids, max_tokens)] on a fresh engine, one step at a time.

    On a CPU the clock is the engine's own CPU time: each step adds the thread CPU time it took,
    so other programs on this shared machine do not enter the numbers. On a GPU (whose kernels
    run asynchronously) it is wall-clock time. Returns per request its arrival, first-scheduled
    and token times (ms), and every step's duration."""
    engine = LLM(model, enable_prefix_caching=False, async_scheduling=False, **engine_kw).llm_engine
    now = clock_for(engine.engine_core.engine_core.device)
    pending = sorted(arrivals, key=lambda a: a[0])
    clock, k, steps = 0.0, 0, []
    arrival, first_sched, tokens = {}, {}, collections.defaultdict(list)
    reqs = {}
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] <= k:
            _, rid, ids, n = pending.pop(0)
            reqs[rid] = queue_request(engine, rid, {"prompt_token_ids": ids}, greedy(n))
            arrival[rid] = clock
        t = now()
        outs = engine.step()
        d = (now() - t) * 1000
        steps.append(d)
        for rid, r in reqs.items():
            if rid not in first_sched and r.num_computed_tokens > 0:
                first_sched[rid] = clock
        clock += d
        for o in outs:
            while len(tokens[o.request_id]) < len(o.outputs[0].token_ids):
                tokens[o.request_id].append(clock)
        k += 1
    return dict(arrival=arrival, first_sched=first_sched, tokens=tokens, steps=steps)


def clock_for(device: torch.device):
    return time.perf_counter if device.type == "cuda" else time.thread_time


def clock_name() -> str:
    return "wall-clock time (GPU)" if torch.cuda.is_available() else "engine CPU time (one thread)"


def ttft(tl, rids) -> float:
    return statistics.fmean(tl["tokens"][r][0] - tl["arrival"][r] for r in rids)


def gaps(tl, rids) -> list[float]:
    return [b - a for r in rids for a, b in zip(tl["tokens"][r], tl["tokens"][r][1:])]


def scatter(points: dict[str, tuple[float, float]], xlabel: str, ylabel: str, width: int = 48,
            height: int = 12) -> Text:
    """A terminal scatter plot: each point drawn as its label's first character."""
    xs, ys = [p[0] for p in points.values()], [p[1] for p in points.values()]
    x0, x1, y0, y1 = 0.0, max(xs) * 1.1, 0.0, max(ys) * 1.1
    grid = [[" "] * width for _ in range(height)]
    for label, (x, y) in points.items():
        col = min(width - 1, int((x - x0) / (x1 - x0) * (width - 1)))
        row = height - 1 - min(height - 1, int((y - y0) / (y1 - y0) * (height - 1)))
        grid[row][col] = label[0]
    out = Text()
    for i, row in enumerate(grid):
        tick = f"{y1 * (height - 1 - i) / (height - 1):7.0f} │" if i % 3 == 0 else "        │"
        out.append(tick, style="dim")
        out.append("".join(row) + "\n", style="bold cyan")
    out.append("        └" + "─" * width + "\n", style="dim")
    out.append(f"         0{'':{width // 2 - 2}}{x1 / 2:.1f}{'':{width // 2 - 8}}{x1:.1f}\n", style="dim")
    out.append(f"         x: {xlabel}   y: {ylabel}", style="dim")
    return out


def chunk_sweep(lesson) -> None:
    long_len = min(384, lesson.llms[0].llm_engine.max_model_len // 2)  # the served engine's model
    decoders = [(0, f"d{i}", [(5 * i + j) % 250 for j in range(16)], 48) for i in range(6)]
    longs = [(6, f"L{i}", [(3 * i + 7 * j) % 250 for j in range(long_len)], 4) for i in range(2)]
    lesson.say(f"**Sweep 1: the chunk size.** Six requests are decoding when two {long_len}-token prompts arrive. "
               f"`max_num_batched_tokens` caps a step's tokens, so it is also the prefill chunk size. Runs with "
               f"{', '.join(map(str, BUDGETS))}. The clock: {clock_name()}"
               + ("" if torch.cuda.is_available() else ", so other programs on this shared machine stay out of it")
               + ".")
    lesson.predict("Which chunk size gives the two long prompts the shortest TTFT, and which gives the decoding "
                   "requests the smoothest stream (smallest worst gap between two tokens)?",
                   "The largest chunk prefills a prompt in one or two steps: shortest TTFT, but those steps are "
                   "long and every decoding request waits through them. The smallest chunk does the opposite.")
    results = {}
    for b in BUDGETS:
        tl = timeline(lesson.model, decoders + longs, max_num_batched_tokens=b, num_kv_blocks=128)
        g = gaps(tl, [d[1] for d in decoders])
        results[b] = dict(ttft=ttft(tl, [x[1] for x in longs]), itl_mean=statistics.fmean(g), itl_max=max(g),
                          steps=len(tl["steps"]))
    lesson.show(table(["max_num_batched_tokens", "steps", "TTFT of the long prompts (ms)",
                       "decoders' mean ITL (ms)", "decoders' worst ITL (ms)"],
                      [[b, r["steps"], f"{r['ttft']:.1f}", f"{r['itl_mean']:.2f}", f"{r['itl_max']:.1f}"]
                       for b, r in results.items()], title=f"measured on this machine, {clock_name()}"))
    marks = dict(zip(BUDGETS, "ABCDEFGH"))
    lesson.show(scatter({marks[b]: (r["itl_max"], r["ttft"]) for b, r in results.items()},
                        "decoders' worst ITL (ms)", "long prompts' TTFT (ms)"),
                title="the trade-off, one point per chunk size: "
                      + ", ".join(f"{m} = {b}" for b, m in marks.items()))
    lo, hi = results[BUDGETS[0]], results[BUDGETS[-1]]
    lesson.check(lo["ttft"] > hi["ttft"], f"chunk {BUDGETS[0]}: TTFT {lo['ttft']:.1f} ms, longer than "
                 f"{hi['ttft']:.1f} ms with {BUDGETS[-1]}: the prompt is spread over more steps")
    worst = (f"the worst gap a decoding request sees is {lo['itl_max']:.1f} ms with chunk {BUDGETS[0]} against "
             f"{hi['itl_max']:.1f} ms with {BUDGETS[-1]}")
    if torch.cuda.is_available():  # a model this small is launch-bound on a GPU: a big step costs little more
        lesson.say(f"Here {worst}. With a model this small a GPU step costs about the same whatever its tokens "
                   "(launch overhead dominates), so the ITL side of the trade-off can be small; with a real model "
                   "a long prefill step stalls every decoding request.")
    else:
        lesson.check(lo["itl_max"] < hi["itl_max"], f"but {worst}: no step is long")


def seqs_sweep(lesson) -> None:
    reqs = [(0, f"r{i}", [(9 * i + j) % 250 for j in range(32)], 16) for i in range(12)]
    lesson.say("**Sweep 2: max_num_seqs.** Twelve requests (32-token prompts, 16 tokens each) arrive together. "
               f"`max_num_seqs` caps the running batch; runs with {', '.join(map(str, SEQS))}.")
    results = {}
    for s in SEQS:
        tl = timeline(lesson.model, reqs, max_num_seqs=s, num_kv_blocks=128)
        rids = [r[1] for r in reqs]
        total = tl["tokens"] and max(t[-1] for t in tl["tokens"].values())
        results[s] = dict(queue=statistics.fmean(tl["first_sched"][r] - tl["arrival"][r] for r in rids),
                          ttft=ttft(tl, rids), itl=statistics.fmean(gaps(tl, rids)),
                          tput=sum(len(t) for t in tl["tokens"].values()) / total * 1000, steps=len(tl["steps"]))
    lesson.show(table(["max_num_seqs", "steps", "mean queue time (ms)", "mean TTFT (ms)", "mean ITL (ms)",
                       "output tokens/s"],
                      [[s, r["steps"], f"{r['queue']:.1f}", f"{r['ttft']:.1f}", f"{r['itl']:.2f}", f"{r['tput']:.0f}"]
                       for s, r in results.items()], title=f"measured on this machine, {clock_name()}"))
    lo, hi = results[SEQS[0]], results[SEQS[-1]]
    lesson.check(lo["queue"] > hi["queue"] and lo["ttft"] > hi["ttft"],
                 f"max_num_seqs={SEQS[0]}: requests queue {lo['queue']:.1f} ms on average (TTFT {lo['ttft']:.1f} ms) "
                 f"against {hi['queue']:.1f} ms ({hi['ttft']:.1f} ms) with {SEQS[-1]}")
    lesson.check(
        hi["tput"] > lo["tput"],
        f"a batch of {SEQS[-1]} gets more tokens per second ({hi['tput']:.0f} against "
        f"{lo['tput']:.0f}): a step's fixed cost is shared by more requests",
    )
    lesson.say(f"What the big batch may cost is step time: here mean ITL was {hi['itl']:.2f} ms with {SEQS[-1]} "
               f"against {lo['itl']:.2f} ms with {SEQS[0]} ({'longer' if hi['itl'] > lo['itl'] else 'not longer'}). "
               "On a GPU with a large model a decode step is dominated by reading the weights, so ITL grows slowly "
               "with the batch until the batch gets large.")


# ---- what only a GPU shows ------------------------------------------------------------------------
def gpu_only(lesson) -> None:
    lesson.say(
        "**What only a GPU shows.** (1) *CUDA graphs*: vLLM captures graphs per **number of tokens** in a "
        "step, by default `[1, 2, 4] + range(8, 256, 8) + range(256, max + 1, 16)` with max = "
        "min(2 × max_num_seqs, 512) without speculative decoding (`VllmConfig._set_cudagraph_sizes` in "
        "`vllm/config/vllm.py`), and "
        "replays them, replacing hundreds of launches from Python with a few. The default `cudagraph_mode`, "
        "FULL_AND_PIECEWISE (`CompilationConfig` in `vllm/config/compilation.py`), replays one *full* graph, "
        "attention included, for a decode-only step, and *piecewise* graphs (everything between the "
        "attention calls, which run eagerly) for mixed and prefill steps of at most max tokens "
        "(`CudaGraphManager.dispatch` in `vllm/v1/worker/gpu/cudagraph_utils.py`, the default model runner's); "
        "larger steps run eagerly. "
        "A decode step of 5 tokens is padded to the next captured size, 8, and the padding rows' outputs "
        "are dropped. (2) *Memory profiling*: at startup vLLM runs a dummy "
        "forward pass of `max_num_batched_tokens` tokens, measures the peak activation memory, and gives "
        "the KV cache what is left of `gpu_memory_utilization` × GPU memory after weights, activations "
        "and other allocations; it logs the result as *GPU KV cache size: N tokens* and *Maximum "
        "concurrency for L tokens per request: X×*.")
    sizes = capture_sizes(max_num_seqs=256)
    lesson.check(sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 512 and 248 in sizes and 272 in sizes
                 and 264 not in sizes and len(sizes) == 3 + 31 + 17,
                 "with max_num_seqs 256 that is 51 token counts: 1, 2, 4, 8, 16, …, 248 (steps of 8), then 256, "
                 "272, …, 512 (steps of 16)")
    if not torch.cuda.is_available():
        lesson.say("This machine has no CUDA device, so both parts are **skipped here**: they need a GPU. "
                   "Run this lesson on a machine with one to see them measured.")
        lesson.check(not torch.cuda.is_available(), "skipped honestly: torch.cuda.is_available() is False")
        return
    cuda_graphs(lesson)
    memory_profile(lesson)


def capture_sizes(max_num_seqs: int = 16) -> list[int]:
    """vLLM V1's default CUDA-graph capture sizes, in tokens (see gpu_only)."""
    top = min(2 * max_num_seqs, 512)
    return [s for s in (1, 2, 4) if s <= top] + list(range(8, min(top + 1, 256), 8)) + list(range(256, top + 1, 16))


def cuda_graphs(lesson) -> None:
    """Capture the non-attention part of a decode step, as one of vLLM V1's piecewise graphs does (its
    full decode graphs hold attention too), for one padded token count, replay it, and time it against
    eager launches."""
    llm, _ = lesson.engine(num_kv_blocks=64, device="cuda")
    model = llm.llm_engine.engine_core.engine_core.model
    n, size = 5, next(s for s in capture_sizes() if s >= 5)

    def dense(x):
        for blk in model.h:
            x = x + blk.mlp(blk.ln_2(x))
        return model.compute_logits(model.ln_f(x))

    dtype = next(model.parameters()).dtype
    with torch.inference_mode():
        static_in = torch.zeros(size, model.cfg.n_embd, device="cuda", dtype=dtype)
        x = torch.randn(n, model.cfg.n_embd, device="cuda", dtype=dtype)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                dense(static_in)  # warm up on a side stream, as torch's docs ask before capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = dense(static_in)
        static_in[:n].copy_(x)
        static_in[n:].zero_()  # the padding rows
        graph.replay()
        eager = dense(x)
        graphed = static_out[:n].clone()

        def timed(fn, reps=200) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) * 1000 / reps  # µs

        t_eager, t_graph = timed(lambda: dense(x)), timed(graph.replay)
    lesson.show(
        table(
            ["", ""],
            [
                ["capture sizes (max_num_seqs 16)", capture_sizes()],
                ["batch", f"{n} → padded to {size}"],
                ["eager (µs per step part)", f"{t_eager:.1f}"],
                ["graph replay (µs)", f"{t_graph:.1f}"],
            ],
            title="CUDA graph of the non-attention layers, measured on this GPU",
        )
    )
    lesson.check(torch.allclose(graphed.float(), eager.float(), atol=1e-2, rtol=1e-2),
                 f"the replayed graph's first {n} rows equal the eager result; the {size - n} padding rows are dropped")
    lesson.check(t_graph < t_eager, f"replay takes {t_graph:.1f} µs against {t_eager:.1f} µs of eager launches")


def memory_profile(lesson) -> None:
    budget_tokens = 2048
    llm, _ = lesson.engine(num_kv_blocks=64, device="cuda", max_num_batched_tokens=budget_tokens)
    engine = llm.llm_engine
    cfg, bs = engine.engine_core.engine_core.model_config, engine.config.cache.block_size
    weights = sum(p.numel() * p.element_size() for p in engine.engine_core.engine_core.model.parameters())
    n = min(budget_tokens, engine.max_model_len - 1)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    engine.add_request("profile", {"prompt_token_ids": [0] * n}, greedy(1))
    while engine.has_unfinished_requests():
        engine.step()  # the profiling run: the largest step the scheduler can make
    torch.cuda.synchronize()
    activations = torch.cuda.max_memory_allocated() - base
    free, total = torch.cuda.mem_get_info()
    non_torch = (total - free) - torch.cuda.memory_reserved()
    util = engine.config.cache.gpu_memory_utilization
    kv_bytes = int(total * util) - weights - activations - max(0, non_torch)
    per_block = bytes_per_block(cfg, bs, engine.engine_core.engine_core.dtype)
    blocks = kv_bytes // per_block
    tokens = blocks * bs
    lesson.show(
        table(
            ["", "bytes"],
            [
                ["total × gpu_memory_utilization", f"{int(total * util):,}"],
                ["− weights", f"{weights:,}"],
                [f"− peak activations ({n} tokens)", f"{activations:,}"],
                ["− other (CUDA context, …)", f"{max(0, non_torch):,}"],
                ["= KV cache", f"{kv_bytes:,}"],
            ],
            title="the memory profile, measured",
        )
    )
    lesson.say(
        f"GPU KV cache size: {tokens:,} tokens\n\n"
        f"Maximum concurrency for {engine.max_model_len:,} tokens per request: {tokens / engine.max_model_len:.2f}x"
    )
    lesson.check(activations > 0 and blocks > 0 and tokens == blocks * bs,
                 f"{blocks:,} blocks of {per_block:,} bytes fit: {tokens:,} tokens of KV cache")


if __name__ == "__main__":
    sys.exit(main(globals()))
