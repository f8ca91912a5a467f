"""Is the built-in model small enough? The sizing targets for `tiny-gpt2`, measured in one run.

    python -m benchmarks.builtin_model [--model tiny-gpt2] [--reps 3] [--threads 1]

  serve ready      seconds from `vllm-trace serve MODEL --no-tui` starting to its "Ready:" line,
                   with the engine core in its own process (the default) and in one process
                   (--no-multiprocessing); target <= 3 s
  decode step      median wall time of one engine step that decodes 8 running requests (64-token
                   prompts, so the contexts are 64-80 tokens), attention on the torch backend
                   (target <= 10 ms) and on the Triton kernels (target <= 150 ms; interpreted on
                   a CPU, TRITON_INTERPRET=1)

The targets are for 2 CPU cores. Other jobs on the machine inflate every figure: read them with
the load average printed at the end.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NUM_REQUESTS, PROMPT_TOKENS, DECODE_STEPS = 8, 64, 16


def serve_ready_s(model: str, *flags: str) -> float:
    """Seconds from spawning serve to its ready line (the process is then stopped)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "tracer.cli", "serve", model, "--port", "0", "--no-tui", *flags],
                            cwd=ROOT, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            env=os.environ | {"PYTHONPATH": str(ROOT)})
    try:
        for line in proc.stderr:
            if line.startswith("Ready:"):
                return time.perf_counter() - t0
        raise RuntimeError(f"serve {model} exited before its ready line (status {proc.wait()})")
    finally:
        proc.terminate()
        proc.wait(30)


def decode_step_ms(model: str, backend: str, threads: int) -> float:
    """Median ms of an engine step decoding NUM_REQUESTS requests, in a fresh interpreter (the Triton
    interpreter must be switched on before the kernels are imported)."""
    code = f"""
import statistics, time, torch
torch.set_num_threads({threads})
from engine import LLM, SamplingParams
llm = LLM({model!r}, attention_backend={backend!r}, num_kv_blocks=128)
eng = llm.llm_engine
params = SamplingParams(temperature=0, max_tokens={DECODE_STEPS + 2}, ignore_eos=True)
for i in range({NUM_REQUESTS}):
    eng.add_request(f"r{{i}}", {{"prompt_token_ids": [(7 * i + j) % 200 + 10 for j in range({PROMPT_TOKENS})]}}, params)
while any(r.num_computed_tokens < len(r.prompt_token_ids) for r in eng.engine_core.engine_core.requests.values()):
    eng.step()  # the prefills
times = []
for _ in range({DECODE_STEPS}):
    t0 = time.perf_counter()
    eng.step()
    times.append((time.perf_counter() - t0) * 1000)
print(statistics.median(times))
"""
    env = os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(threads)}
    if backend == "triton":
        env["TRITON_INTERPRET"] = env.get("TRITON_INTERPRET", "1")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(out.stderr[-2000:])
    return float(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-gpt2")
    ap.add_argument("--reps", type=int, default=3, help="repetitions of each measurement (medians are printed)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the decode-step engine")
    args = ap.parse_args(argv)
    rows = []
    for label, flags, target in (("serve ready, engine core in its own process (s)", (), 3.0),
                                 ("serve ready, one process (s)", ("--no-multiprocessing",), 3.0)):
        runs = [serve_ready_s(args.model, *flags) for _ in range(args.reps)]
        rows.append((label, runs, target))
        print(f"{label}: {', '.join(f'{x:.2f}' for x in runs)}", flush=True)
    for backend, target in (("torch", 10.0), ("triton", 150.0)):
        label = f"decode step, {NUM_REQUESTS} requests, {backend} attention (ms)"
        runs = [decode_step_ms(args.model, backend, args.threads) for _ in range(args.reps)]
        rows.append((label, runs, target))
        print(f"{label}: {', '.join(f'{x:.1f}' for x in runs)}", flush=True)
    print(f"\n{args.model}, {args.reps} repetitions each, {args.threads} torch thread(s) for the decode steps")
    for label, runs, target in rows:
        med = statistics.median(runs)
        print(f"  {label:<58} {med:8.2f}   target <= {target:g}   {'ok' if med <= target else 'MISSED'}")
    print(f"load average while measuring: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
