"""`make parity`: vLLM's own CPU build beside ours: the same tokens, the same API and metrics, the speed of each.

    python -m benchmarks.parity --vllm-python .venv-vllm/bin/python [--parts tokens api serving]

tokens    every checkpoint in benchmarks/parity/models.py through both engines' LLM.generate (tokens.py);
          tiny-gpt2 and the Llama-shaped tiny-llama-hd32 also time an offline batch (vs_vllm.py's workload)
api       both servers on tiny-gpt2, started the same way: the same requests, field sets, metrics (api.py)
serving   `vllm bench serve` against both servers at concurrency 32, once (benchmarks/serving.py repeats it
          over concurrencies 1 to 64 for RESULTS.md)

Exits 1 when a difference is not explained; prints what differs by design, and the tables. It takes 20 to 40
minutes on 2 cores, most of it vLLM's start (torch.compile of each checkpoint: 2.5 minutes measured on a busy
machine, up to 9 on a very busy one), five checkpoints and one server.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import serving, vs_vllm
from benchmarks.parity import api, tokens
from benchmarks.parity.models import checkpoints
from benchmarks.parity.servers import Server, chat_template_file

OFFLINE = ("tiny-gpt2", "tiny-llama-hd32")


def part_tokens(vllm_python: str, workdir: Path, models: list[str] | None = None) -> tuple[list[str], dict]:
    problems, table, offline = [], {}, {}
    for name, path in checkpoints(workdir / "models", models).items():
        job = tokens.job(path)
        if name in OFFLINE:
            job["throughput"] = {"prompts": vs_vllm.workload(64), "max_tokens": 64, "reps": 1}
        print(f"  tokens: {name} ...", file=sys.stderr, flush=True)
        v = tokens.run_side(vllm_python, "vllm", job, workdir, name)
        o = tokens.run_side(sys.executable, "ours", job, workdir, name)
        p, summary = tokens.compare(v, o)
        problems += [f"{name}: {x}" for x in p]
        table[name] = summary | {"problems": len(p), "vllm_startup_s": round(v["startup_s"], 1),
                                 "ours_startup_s": round(o["startup_s"], 1)}
        if name in OFFLINE:
            offline[name] = {"vllm": v["throughput"]["output_tok_s"], "ours": o["throughput"]["output_tok_s"]}
    return problems, {"tokens": table, "offline": offline}


def part_api(vllm_bin: str, workdir: Path, with_serving: bool) -> tuple[list[str], dict]:
    model = str(api_model())
    template = chat_template_file(workdir)
    ours_bin = str(Path(sys.executable).parent)
    with Server("vllm", vllm_bin, model, 8790, template, workdir / "vllm-serve.log") as v, \
            Server("ours", ours_bin, model, 8791, template, workdir / "ours-serve.log") as o:
        problems, notes = api.compare_requests(v.url, o.url, model)
        mp, mn = api.compare_metrics(v.url, o.url)
        out = {"notes": notes + mn}
        if with_serving:  # one server driven at a time, the other idle
            out["serving"] = {s.kind: {32: [serving.bench(vllm_bin, s, model, 32, workdir)]} for s in (v, o)}
    return problems + mp, out


def api_model() -> Path:
    return Path(__file__).resolve().parents[2] / "engine" / "builtin" / "tiny-gpt2"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vllm-python", default=".venv-vllm/bin/python")
    ap.add_argument("--parts", nargs="+", default=["tokens", "api", "serving"], choices=["tokens", "api", "serving"])
    ap.add_argument("--models", nargs="+", default=None, metavar="NAME",
                    help="the tokens part on these checkpoints only (default: all of benchmarks/parity/models.py)")
    ap.add_argument("--json", metavar="PATH", help="also write the results here")
    a = ap.parse_args()
    vllm_python = str(Path(a.vllm_python).absolute())
    if not Path(vllm_python).exists():
        sys.exit(f"no {vllm_python}: run `make parity-setup` first")
    t0, problems, results = time.monotonic(), [], {}
    with tempfile.TemporaryDirectory(prefix="vllm-trace-parity-") as d:
        workdir = Path(d)
        if "tokens" in a.parts:
            p, r = part_tokens(vllm_python, workdir, a.models)
            problems += p
            results |= r
        if "api" in a.parts or "serving" in a.parts:
            p, r = part_api(str(Path(vllm_python).parent), workdir, "serving" in a.parts)
            problems += p if "api" in a.parts else []
            results |= r
    report(results)
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    print(f"\nparity took {time.monotonic() - t0:.0f} s")
    if problems:
        print(f"\n{len(problems)} unexplained difference(s):\n  " + "\n  ".join(problems))
        sys.exit(1)
    print("no unexplained differences")


def report(results: dict) -> None:
    if "tokens" in results:
        print("\nSame tokens (greedy ids, top-5 logprobs, n=2, seeded reproducibility):")
        for name, row in results["tokens"].items():
            print(f"  {name:<16} {json.dumps(row)}")
    if results.get("offline"):
        print("\nOffline output tokens/s (64 prompts x 64 tokens, one run):")
        for name, r in results["offline"].items():
            v, o = statistics.median(r["vllm"]), statistics.median(r["ours"])
            print(f"  {name:<16} vLLM {v:8.1f}   ours {o:8.1f}   ours / vLLM {o / v:.2f}")
    for note in results.get("notes", []):
        print(f"  by design: {note}")
    if "serving" in results:
        print("\n`vllm bench serve`, concurrency 32, one run:\n" + serving.table(results["serving"]))


if __name__ == "__main__":
    main()
