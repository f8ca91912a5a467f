"""Throughput: our engine against Hugging Face transformers on the same workload, one run.

    python -m benchmarks.throughput [--model tiny-gpt2] [--num-requests 32]

Prints output tokens/s for our LLM.generate with async scheduling (vLLM's default with CUDA: step N+1 is
scheduled while step N's forward pass runs) and without, their ratio, for transformers' generate per
request and in left-padded batches, and the ratio to the best transformers configuration. Padded batches
generate until their longest request is done; only the tokens each request asked for count.
Then engine overhead: mean engine step time / bare model forward (+ logits) time on the same
batch of decodes, with LLM.generate's final-only outputs and with streamed (cumulative) ones.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.workload import make_workload
from engine import LLM, SamplingParams


def bench_ours(model: str, work, async_scheduling: bool = True) -> tuple[float, int]:
    llm = LLM(model, max_num_seqs=256, async_scheduling=async_scheduling)
    # warm up on the workload's own batch shapes (on CUDA, a step of a new shape compiles Triton's kernels
    # for it: seconds), then forget its prompts, so the timed run computes every prefill
    llm.generate([{"prompt_token_ids": p} for p, _ in work], SamplingParams(max_tokens=2), use_tqdm=False)
    llm.reset_prefix_cache()
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in work], [s for _, s in work], use_tqdm=False)
    dt = time.perf_counter() - t
    return dt, sum(len(o.outputs[0].token_ids) for o in outs)


def bench_hf(path: str, work, batch_size: int | None) -> tuple[float, int]:
    from transformers import GPT2LMHeadModel
    model = GPT2LMHeadModel.from_pretrained(path).eval()
    pad = model.config.eos_token_id
    tokens = sum(s.max_tokens for _, s in work)
    t = time.perf_counter()
    with torch.inference_mode():
        if batch_size is None:
            for p, s in work:
                x = torch.tensor([p])
                model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=s.max_tokens,
                               min_new_tokens=s.max_tokens, pad_token_id=pad)
        else:
            for i in range(0, len(work), batch_size):
                chunk = work[i:i + batch_size]
                width = max(len(p) for p, _ in chunk)
                ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in chunk])
                mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in chunk])
                n = max(s.max_tokens for _, s in chunk)
                model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=n, min_new_tokens=n,
                               pad_token_id=pad)
    return time.perf_counter() - t, tokens


def engine_overhead(model: str, output_kind: str, batch: int = 32, steps: int = 30) -> tuple[float, float]:
    """(mean engine.step() seconds, mean bare forward+logits seconds) for `batch` decodes.
    output_kind "final_only" is how LLM.generate runs (no RequestOutput until a request ends);
    "cumulative" is how the server streams (one RequestOutput per request per step)."""
    llm = LLM(model, max_num_seqs=batch, async_scheduling=False)  # one step() is one whole step
    engine = llm.llm_engine
    for i in range(batch):
        engine.add_request(str(i), {"prompt_token_ids": [(i * 13 + j) % 250 for j in range(32)]},
                           SamplingParams(temperature=0, max_tokens=steps * 3 + 10, ignore_eos=True,
                                          output_kind=output_kind))
    engine.step()  # the prefill of all of them
    step_times, fwd_times = [], []
    runner = engine.engine_core.engine_core.model_runner
    batches, prepare = [], runner.prepare_inputs
    runner.prepare_inputs = lambda sched: batches.append(prepare(sched)) or batches[-1]
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        step_times.append(time.perf_counter() - t)
        # The step's own batch (32 decodes) again, forward only: it rewrites the same K/V at the
        # same slots, so nothing needs undoing.
        inp = runner.model_input_of(batches.pop())
        with torch.inference_mode():
            t = time.perf_counter()
            runner.forward(inp)
            fwd_times.append(time.perf_counter() - t)
    return statistics.mean(step_times[3:]), statistics.mean(fwd_times[3:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-gpt2")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reps", type=int, default=3, help="interleaved repetitions (median reported)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads for both engines (default: torch's)")
    args = ap.parse_args()
    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)
    llm_path = str(LLM(args.model, num_kv_blocks=2).llm_engine.engine_core.engine_core.model_path)
    from pathlib import Path

    from engine.model_executor.model_loader import read_config
    cfg = read_config(Path(llm_path))
    work = make_workload(args.num_requests, vocab_size=cfg.vocab_size, seed=args.seed)
    print(f"model {args.model} ({cfg.n_layer} layers, {cfg.n_embd} wide), {len(work)} requests, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}")
    configs = [("vllm-trace LLM.generate", lambda: bench_ours(args.model, work)),
               ("vllm-trace LLM.generate, async off", lambda: bench_ours(args.model, work, False)),
               ("transformers, per request", lambda: bench_hf(llm_path, work, None))]
    configs += [(f"transformers, padded batches of {b}", lambda b=b: bench_hf(llm_path, work, b))
                for b in (8, len(work))]
    # Interleaved repetitions, median time: a load spike on a shared machine hits one run of
    # each configuration, not one configuration.
    times: dict[str, list[float]] = {name: [] for name, _ in configs}
    tokens: dict[str, int] = {}
    for rep in range(args.reps):
        for name, run in configs:
            dt, n = run()
            times[name].append(dt)
            tokens[name] = n
    rows = [(name, statistics.median(times[name]), tokens[name]) for name, _ in configs]
    print(f"median of {args.reps} interleaved repetitions")
    print(f"{'configuration':40s} {'seconds':>8s} {'out tok':>8s} {'tok/s':>9s}")
    for name, dt, n in rows:
        print(f"{name:40s} {dt:8.2f} {n:8d} {n / dt:9.1f}")
    ours = rows[0][2] / rows[0][1]
    best = max(n / dt for _, dt, n in rows[2:])
    print(f"ratio ours / best transformers: {ours / best:.2f}x  (target >= 2x)")
    print(f"async scheduling on / off: {ours / (rows[1][2] / rows[1][1]):.2f}x")
    for kind, target in (("final_only", "  (target <= 1.15; LLM.generate's outputs)"),
                         ("cumulative", "  (streamed outputs, as the server asks)")):
        runs = sorted((engine_overhead(args.model, kind) for _ in range(args.reps)), key=lambda sf: sf[0] / sf[1])
        step, fwd = runs[len(runs) // 2]  # the median ratio
        print(f"engine overhead at batch 32 decode, {kind:10s}: step {step * 1e3:.2f} ms / forward "
              f"{fwd * 1e3:.2f} ms = {step / fwd:.2f}{target}")


if __name__ == "__main__":
    main()
