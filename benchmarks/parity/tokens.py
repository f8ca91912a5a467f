"""Same tokens: one seeded batch of prompts through vLLM's ``LLM.generate`` and ours, per checkpoint.

    greedy       token ids equal, except after a near-tie: where the two engines part, vLLM's own best two
                 logprobs there must be within NEAR_TIE (float32 sums in another order may swap them; after
                 that the texts differ legitimately). At most a quarter of the prompts may part so.
    logprobs     the top-5 logprobs of every generated token (up to where the texts part) and of every prompt
                 token: the same ids, and values within LOGPROB_TOL (absolute), a token tied at the top-k
                 boundary excepted
    n=2 greedy   both samples of each prompt equal vLLM's (top_k=1: vLLM refuses n > 1 at temperature 0,
                 which we accept)
    seeded       sampled with temperature 0.8, n=2, a seed per request: each engine gives the same tokens on a
                 second run (vLLM's CPU sampler is deterministic with a seed: a torch.Generator per request),
                 but the two engines' tokens are not compared: vLLM draws exponential noise from that generator
                 (q = Exp(1), argmax p / q), ours Gumbel noise keyed by (seed, position) as vLLM 0.33's
                 Gumbel-max sampler does, so the same seed names a different random stream in each.
"""
from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

NEAR_TIE = 2e-3
LOGPROB_TOL = 2e-3
MAX_TOKENS = 24


def job(model: str, num_prompts: int = 8, seed: int = 0, vocab: int = 4096) -> dict:
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, vocab) for _ in range(rng.randint(4, 40))] for _ in range(num_prompts)]
    greedy = dict(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return {"model": model, "seed": seed, "prompts": prompts, "runs": [
        {"name": "greedy", "params": dict(greedy, logprobs=5, prompt_logprobs=5)},
        # vLLM refuses n > 1 with temperature 0; top_k=1 is the same argmax with a temperature
        {"name": "n2_greedy", "params": dict(greedy, temperature=1.0, top_k=1, n=2)},
        {"name": "seeded", "params": dict(temperature=0.8, n=2, seed=1234, max_tokens=12, ignore_eos=True)},
        {"name": "seeded_again", "params": dict(temperature=0.8, n=2, seed=1234, max_tokens=12, ignore_eos=True)},
    ]}


def run_side(python: str, engine: str, job_: dict, workdir: Path, name: str) -> dict:
    jpath, opath = workdir / f"{name}.job.json", workdir / f"{name}.{engine}.json"
    jpath.write_text(json.dumps(job_))
    log = workdir / f"{name}.{engine}.log"
    with open(log, "w") as f:
        cmd = [python, "-m", "benchmarks.parity.generate", "--engine", engine, str(jpath), str(opath)]
        code = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=Path(__file__).parents[2]).returncode
    if code != 0:
        raise RuntimeError(f"{engine} generate failed ({code}) on {name}: see {log}")
    return json.loads(opath.read_text())


def _topk_close(a: dict, b: dict, where: str, problems: list[str]) -> float:
    """Compare two {id: logprob} top-k dicts; the largest difference on their shared ids."""
    shared = a.keys() & b.keys()
    worst = max((abs(a[t] - b[t]) for t in shared), default=0.0)
    if worst > LOGPROB_TOL:
        problems.append(f"{where}: logprobs differ by {worst:.2e} (> {LOGPROB_TOL})")
    for t in a.keys() ^ b.keys():  # only at the top-k boundary, between near-equal values
        lp = a.get(t, b.get(t))
        edge = min(min(a.values()), min(b.values()))
        if abs(lp - edge) > NEAR_TIE:
            problems.append(f"{where}: token {t} ({lp:.4f}) in one top-k only, not at its boundary ({edge:.4f})")
    return worst


def compare_greedy(v: list, o: list, problems: list[str]) -> dict:
    parted, worst = 0, 0.0
    for i, (vp, op) in enumerate(zip(v, o, strict=True)):
        vs, os_ = vp["samples"][0], op["samples"][0]
        vi, oi = vs["token_ids"], os_["token_ids"]
        upto = len(vi)
        if vi != oi:
            upto = next(j for j, (a, b) in enumerate(zip(vi, oi)) if a != b)
            top = sorted(vs["logprobs"][upto].values(), reverse=True)
            if top[0] - top[1] >= NEAR_TIE:
                problems.append(f"prompt {i}: token {upto} differs (vLLM {vi[upto]}, ours {oi[upto]}) with "
                                f"vLLM's margin {top[0] - top[1]:.2e}: not a near-tie")
            parted += 1
        for j in range(upto):
            worst = max(worst, _topk_close(vs["logprobs"][j], os_["logprobs"][j], f"prompt {i} token {j}", problems))
        for j, (a, b) in enumerate(zip(vp["prompt_logprobs"], op["prompt_logprobs"])):
            if (a is None) != (b is None):
                problems.append(f"prompt {i} prompt token {j}: logprobs given by one engine only")
            elif a is not None:
                worst = max(worst, _topk_close(a, b, f"prompt {i} prompt token {j}", problems))
    if parted > len(v) // 4:
        problems.append(f"{parted} of {len(v)} prompts parted at near-ties: too many to trust")
    return {"prompts": len(v), "parted_at_near_tie": parted, "max_logprob_diff": worst}


def compare(v: dict, o: dict) -> tuple[list[str], dict]:
    failed = [f"{side} {name}: {r['error']}" for side, res in (("vLLM", v), ("ours", o))
              for name, r in res["runs"].items() if isinstance(r, dict) and "error" in r]
    if failed:
        return failed, {"failed_runs": len(failed)}
    problems: list[str] = []
    summary = compare_greedy(v["runs"]["greedy"], o["runs"]["greedy"], problems)
    for i, (vp, op) in enumerate(zip(v["runs"]["n2_greedy"], o["runs"]["n2_greedy"])):
        if [s["token_ids"] for s in vp["samples"]] != [s["token_ids"] for s in op["samples"]]:
            problems.append(f"n=2 greedy, prompt {i}: samples differ")
    for side, r in (("vLLM", v), ("ours", o)):
        again = [[s["token_ids"] for s in p["samples"]] for p in r["runs"]["seeded_again"]]
        if [[s["token_ids"] for s in p["samples"]] for p in r["runs"]["seeded"]] != again:
            problems.append(f"seeded sampling: {side} gave other tokens on a second run with the same seed")
    seeded = sum(vs["token_ids"] == os_["token_ids"] for vp, op in zip(v["runs"]["seeded"], o["runs"]["seeded"])
                 for vs, os_ in zip(vp["samples"], op["samples"]))
    summary["seeded_samples_equal_across_engines"] = f"{seeded}/{2 * len(v['runs']['seeded'])} (not expected)"
    return problems, summary


def run(models: dict[str, str], vllm_python: str, workdir: Path) -> tuple[list[str], dict]:
    problems, table = [], {}
    for name, path in models.items():
        j = job(path)
        print(f"  tokens: {name} ...", file=sys.stderr, flush=True)
        v = run_side(vllm_python, "vllm", j, workdir, name)
        o = run_side(sys.executable, "ours", j, workdir, name)
        p, summary = compare(v, o)
        problems += [f"{name}: {x}" for x in p]
        table[name] = summary | {"problems": len(p)}
    return problems, table
