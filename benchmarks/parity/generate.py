"""One engine's side of the token comparison: a job (JSON) in, its outputs (JSON) out.

    python -m benchmarks.parity.generate --engine vllm|ours JOB.json OUT.json

It runs under either virtual environment (vLLM's ``.venv-vllm`` has vLLM and not vllm-trace, ours the
opposite), so it imports nothing of this repository but the engine it is asked for. Both engines take
the same ``LLM(model, dtype=..., seed=..., max_model_len=...)`` and ``SamplingParams`` names; vLLM is
built inside ``if __name__ == "__main__"`` (its engine core is a spawned process) and compiles with
torch.compile, as by default.

A job: {"model": DIR, "prompts": [[ids]], "runs": [{"name", "params": {SamplingParams fields}}],
"throughput": {"prompts": [[ids]], "max_tokens": N} (optional)}. Per run, per prompt: each sample's
token ids and per-token top logprobs ({id: logprob}), and the prompt's logprobs when asked; then the
throughput batch's output tokens/s (one warm-up generate first, not timed).
"""
from __future__ import annotations

import argparse
import json
import time


def _load(engine: str, model: str, seed: int):
    if engine == "vllm":
        from vllm import LLM, SamplingParams
        llm = LLM(model=model, dtype="float32", seed=seed, max_model_len=512, max_num_seqs=256,
                  enable_prefix_caching=False, kv_cache_memory_bytes=256 * 2**20)  # our CPU default
    else:
        from engine import LLM, SamplingParams
        llm = LLM(model, dtype="float32", seed=seed, max_model_len=512, max_num_seqs=256,
                  enable_prefix_caching=False)
    return llm, SamplingParams


def _logprobs(entries) -> list | None:
    if entries is None:
        return None
    return [None if e is None else {str(t): float(lp.logprob) for t, lp in e.items()} for e in entries]


def _run(llm, params_cls, prompts: list[list[int]], params: dict) -> list[dict]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params_cls(**params), use_tqdm=False)
    return [{"samples": [{"token_ids": list(c.token_ids), "logprobs": _logprobs(c.logprobs)}
                         for c in sorted(o.outputs, key=lambda c: c.index)],
             "prompt_logprobs": _logprobs(o.prompt_logprobs)} for o in outs]


def _throughput(llm, params_cls, job: dict) -> dict:
    prompts, max_tokens = job["prompts"], job["max_tokens"]
    params = params_cls(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], params, use_tqdm=False)  # warm-up
    runs = []
    for _ in range(job.get("reps", 1)):
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        dt = time.perf_counter() - t
        runs.append(sum(len(o.outputs[0].token_ids) for o in outs) / dt)
    return {"output_tok_s": runs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", choices=("vllm", "ours"), required=True)
    ap.add_argument("job")
    ap.add_argument("out")
    a = ap.parse_args()
    with open(a.job) as f:
        job = json.load(f)
    t = time.perf_counter()
    llm, params_cls = _load(a.engine, job["model"], job.get("seed", 0))
    result = {"engine": a.engine, "startup_s": time.perf_counter() - t, "runs": {}}
    for run in job.get("runs", []):
        try:
            result["runs"][run["name"]] = _run(llm, params_cls, job["prompts"], run["params"])
        except Exception as e:  # one refused run does not cost the others (and the engine's start)
            result["runs"][run["name"]] = {"error": f"{type(e).__name__}: {e}"}
    if job.get("throughput"):
        result["throughput"] = _throughput(llm, params_cls, job["throughput"])
    with open(a.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
