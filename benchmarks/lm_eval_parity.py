"""lm-evaluation-harness through `serve` against its own Hugging Face backend, on the same checkpoint.

    pip install 'lm-eval[api,hf]'        # in any environment: the harness talks to the server over HTTP
    python -m benchmarks.lm_eval_parity [--lm-eval PATH_TO_lm_eval] [--model tiny-gpt2]

Runs two local tasks (benchmarks/lm_eval/: a multiple-choice task, scored by loglikelihood, and a
generate-until task) three ways: `--model hf` on the checkpoint, and `--model local-completions`
against a `vllm-trace serve` it starts, with token-id prompts and with string prompts. The
loglikelihood requests are what the harness sends: ``{"prompt": [[ids]], "max_tokens": 1,
"logprobs": 1, "echo": true, "temperature": 0}``, read back as the prompt's ``token_logprobs`` and
``top_logprobs``. Prints each sample's largest loglikelihood difference, whether every greedy flag
and generation agrees, and each run's scores; exits 1 if they differ.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent / "lm_eval"
TASKS = {
    "vt_mc": dict(output_type="multiple_choice", data="mc.jsonl", doc_to_text="{{question}}",
                  doc_to_choice="{{choices}}", doc_to_target="{{answer}}", metric="acc"),
    "vt_gen": dict(output_type="generate_until", data="gen.jsonl", doc_to_text="{{prompt}}",
                   doc_to_target="{{target}}", metric="exact_match"),
}


def write_tasks(folder: Path) -> None:
    for name, t in TASKS.items():
        lines = [f"task: {name}", "dataset_path: json", "dataset_kwargs:", "  data_files:",
                 f"    test: {HERE / t['data']}", "test_split: test", f"output_type: {t['output_type']}",
                 f'doc_to_text: "{t["doc_to_text"]}"', f'doc_to_target: "{t["doc_to_target"]}"']
        if "doc_to_choice" in t:
            lines.append(f'doc_to_choice: "{t["doc_to_choice"]}"')
        else:
            lines += ["generation_kwargs:", '  until: ["\\n"]', "  max_gen_toks: 16", "  do_sample: false"]
        lines += ["metric_list:", f"  - metric: {t['metric']}"]
        (folder / f"{name}.yaml").write_text("\n".join(lines) + "\n")


def run_lm_eval(lm_eval: str, folder: Path, out: str, model: str, model_args: str) -> dict:
    env = os.environ | {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    cmd = [lm_eval, "--model", model, "--model_args", model_args, "--tasks", ",".join(TASKS),
           "--include_path", str(folder), "--batch_size", "1", "--log_samples", "--output_path", str(folder / out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"lm_eval --model {model} failed:\n{proc.stderr[-2000:]}")
    samples = {}
    for name in TASKS:
        [path] = glob.glob(str(folder / out / "**" / f"samples_{name}_*.jsonl"), recursive=True)
        samples[name] = [json.loads(line) for line in open(path)]
    [results] = glob.glob(str(folder / out / "**" / "results_*.json"), recursive=True)
    return {"samples": samples, "results": json.load(open(results))["results"]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lm-eval", default=shutil.which("lm_eval") or "lm_eval", help="the lm_eval command")
    ap.add_argument("--model", default="tiny-gpt2", help="a built-in model or a local checkpoint directory")
    args = ap.parse_args(argv)
    if shutil.which(args.lm_eval) is None and not Path(args.lm_eval).exists():
        print(f"lm_eval not found ({args.lm_eval}): pip install 'lm-eval[api,hf]' and pass --lm-eval", file=sys.stderr)
        return 2
    from engine.model_executor.model_loader import resolve

    path = str(resolve(args.model))
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "tracer.cli", "serve", args.model, "--no-tui", "--no-trace",
                               "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        import httpx
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            write_tasks(folder)
            served = (f"model={args.model},base_url=http://127.0.0.1:{port}/v1/completions,tokenizer={path},"
                      "tokenizer_backend=huggingface,num_concurrent=1")
            runs = {"hf": run_lm_eval(args.lm_eval, folder, "hf", "hf", f"pretrained={path},dtype=float32"),
                    "serve, token ids": run_lm_eval(args.lm_eval, folder, "ids", "local-completions",
                                                    served + ",tokenized_requests=True"),
                    "serve, strings": run_lm_eval(args.lm_eval, folder, "str", "local-completions",
                                                  served + ",tokenized_requests=False")}
    finally:
        server.terminate()
        server.wait(30)
    ok = True
    hf = runs["hf"]["samples"]
    for name, run in runs.items():
        if name == "hf":
            continue
        mc = [(float(a[0]), a[1], float(b[0]), b[1]) for x, y in zip(hf["vt_mc"], run["samples"]["vt_mc"])
              for a, b in zip(x["filtered_resps"], y["filtered_resps"])]
        diff = max(abs(a - c) for a, _, c, _ in mc)
        greedy = all(b == d for _, b, _, d in mc)
        gens = [x["resps"] for x in hf["vt_gen"]] == [y["resps"] for y in run["samples"]["vt_gen"]]
        ok &= diff < 1e-3 and greedy and gens
        print(f"{name:18s} loglikelihood max |diff| vs hf {diff:.2e} over {len(mc)} choices; greedy flags equal "
              f"{greedy}; generations equal {gens}")
    for name, run in runs.items():
        scores = {t: {k: v for k, v in r.items() if k.endswith(",none") and "stderr" not in k}
                  for t, r in run["results"].items()}
        print(f"{name:18s} {scores}")
    print("parity" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
