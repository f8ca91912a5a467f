"""Serving: vLLM's own client, `vllm bench serve`, against our server and against vLLM's CPU build.

    python -m benchmarks.serving [--model DIR] [--concurrency 1 8 32 64] [--reps 3] [--servers vllm ours]
    python -m benchmarks.serving --servers ours ours-async --reference ours --concurrency 64  # async ÷ sync
    python -m benchmarks.serving --servers ours ours-no-trace --reference ours-no-trace  # tracing on ÷ off
    python -m benchmarks.serving --servers ours ours-no-trace --reference ours-no-trace --prompts-per-stream 8
    python -m benchmarks.serving --servers ours ours-no-trace --reference ours-no-trace --model gpt2-shaped

Both servers are started the same way (benchmarks/parity/servers.py) on the same checkpoint, one after the
other, and stay up; one is driven at a time while the other sits idle (both idle servers wait on their
sockets), and their order alternates from one run to the next, so that a drift of the machine (other jobs)
spreads over both. Restarting a server per run would cost vLLM's torch.compile start each time.
The client is `vllm bench serve --backend openai --dataset-name random
--random-input-len 64 --random-output-len 64 --ignore-eos --seed 0`, 2 prompts a stream (16 at least):
two waves of requests, whose arrival and prefill weigh as much as their decode; `--prompts-per-stream 8`
measures the steady state of decoding more than the bursts. Medians over the repetitions; the spread is
printed too.

Each row also gives every server process's CPU time per output token (/proc utime + stime over the run):
the API server's (HTTP, detokenizing, SSE) and the engine core's (scheduling, the forward pass, sampling),
which is where a served token's time goes. Server variants: `ours-2threads` is our server with the
placement of an offline engine (OMP_NUM_THREADS=2, VLLM_CPU_OMP_THREADS_BIND=nobind), for comparison.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.parity.servers import Server, chat_template_file
from benchmarks.workload import GPT2_SHAPED, resolve_model

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {"vllm": ("vllm", {}), "ours": ("ours", {}), "ours-bound": ("ours", {"VLLM_CPU_OMP_THREADS_BIND": "auto"}),
            "ours-2threads": ("ours", {"OMP_NUM_THREADS": "2", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}),
            "ours-async": ("ours", {}), "ours-no-trace": ("ours", {})}
# our server's flags beyond its defaults
EXTRA_ARGS = {"ours-async": ("--async-scheduling",), "ours-no-trace": ("--no-trace",)}
THREADS = {"vllm": "vLLM's defaults: worker bound to cpu 0 (VLLM_CPU_OMP_THREADS_BIND=auto, 1 core reserved)",
           "ours": "ours by default: engine core 1 torch thread, unbound, 1 core left to the API server; async "
                   "scheduling off (as vLLM on a CPU)",
           "ours-bound": "engine core 1 torch thread bound to cpu 0 (VLLM_CPU_OMP_THREADS_BIND=auto)",
           "ours-2threads": "OMP_NUM_THREADS=2, VLLM_CPU_OMP_THREADS_BIND=nobind (an offline engine's)",
           "ours-async": "ours by default, with async scheduling on (--async-scheduling)",
           "ours-no-trace": "ours by default, with no tracer (--no-trace): what tracing costs a served token"}
PROMPTS_PER_STREAM = 2  # two waves of requests a run (16 prompts at least)
FIELDS = ("output_throughput", "mean_ttft_ms", "median_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "mean_itl_ms",
          "completed")


def cpu_seconds(pids: list[int]) -> dict[int, float]:
    out, tick = {}, os.sysconf("SC_CLK_TCK")
    for pid in pids:
        try:
            fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
            out[pid] = (int(fields[11]) + int(fields[12])) / tick
        except OSError:
            pass
    return out


def process_names(pids: list[int]) -> dict[int, str]:
    names = {}
    for pid in pids:
        try:
            cmd = open(f"/proc/{pid}/cmdline").read().split("\0")
        except OSError:
            continue
        text = " ".join(cmd)
        names[pid] = ("engine core" if "core_proc" in text or "EngineCore" in text else
                      "worker" if "worker_proc" in text else "API server" if " serve " in text else cmd[0])
    return names


def num_prompts(concurrency: int, per_stream: int = PROMPTS_PER_STREAM) -> int:
    """How many prompts a run at this concurrency sends: per_stream a stream, 16 at least."""
    return max(16, per_stream * concurrency)


def bench(vllm_bin: str, server: Server, model: str, concurrency: int, workdir: Path,
          per_stream: int = PROMPTS_PER_STREAM) -> dict:
    num = num_prompts(concurrency, per_stream)
    name = f"{server.kind}-{concurrency}-{time.time_ns()}.json"
    cmd = [os.path.join(vllm_bin, "vllm"), "bench", "serve", "--backend", "openai", "--base-url", server.url,
           "--model", model, "--tokenizer", model, "--dataset-name", "random", "--random-input-len", "64",
           "--random-output-len", "64", "--num-prompts", str(num), "--max-concurrency", str(concurrency),
           "--ignore-eos", "--seed", "0", "--save-result", "--result-dir", str(workdir), "--result-filename", name]
    pids = server.pids()
    before = cpu_seconds(pids)
    done = subprocess.run(cmd, capture_output=True, text=True)
    after = cpu_seconds(pids)
    if done.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed against {server.kind}: {done.stderr[-2000:]}")
    result = json.loads((workdir / name).read_text())
    row = {k: result[k] for k in FIELDS if k in result}
    tokens = result.get("total_output_tokens") or 1
    names = process_names(pids)
    per_proc: dict[str, float] = {}
    for pid, t in after.items():
        label = names.get(pid, str(pid))
        per_proc[label] = per_proc.get(label, 0.0) + (t - before.get(pid, t)) * 1000 / tokens
    row["cpu_ms_per_token"] = {k: round(v, 3) for k, v in per_proc.items() if v > 0}
    return row


def run(vllm_bin: str, model: str, concurrencies: list[int], reps: int, servers: list[str],
        workdir: Path, per_stream: int = PROMPTS_PER_STREAM) -> dict:
    template = chat_template_file(workdir)
    results: dict[str, dict[int, list[dict]]] = {s: {c: [] for c in concurrencies} for s in servers}
    with contextlib.ExitStack() as stack:
        up = {}
        for i, variant in enumerate(servers):  # one at a time: vLLM compiles while nothing else runs
            kind, env = VARIANTS[variant]
            bin_dir = vllm_bin if kind == "vllm" else os.path.dirname(sys.executable)
            up[variant] = stack.enter_context(Server(kind, bin_dir, model, 8701 + i, template,
                                                     workdir / f"{variant}.log", env, EXTRA_ARGS.get(variant, ())))
        for rep in range(reps):
            for c in concurrencies:
                order = servers if (rep + concurrencies.index(c)) % 2 == 0 else servers[::-1]
                for variant in order:
                    row = bench(vllm_bin, up[variant], model, c, workdir, per_stream)
                    results[variant][c].append(row)
                    print(f"  rep {rep + 1} {variant:>13} c={c:<3} {row['output_throughput']:8.1f} tok/s  "
                          f"TTFT {row['mean_ttft_ms']:7.1f} ms  TPOT {row['mean_tpot_ms']:6.2f} ms  "
                          f"CPU ms/token {row['cpu_ms_per_token']}", file=sys.stderr, flush=True)
    return results


def median_row(rows: list[dict]) -> dict:
    out = {k: statistics.median(r[k] for r in rows) for k in FIELDS if k in rows[0]}
    out["output_throughput_all"] = [round(r["output_throughput"], 1) for r in rows]
    procs = {p for r in rows for p in r["cpu_ms_per_token"]}
    out["cpu_ms_per_token"] = {p: round(statistics.median(r["cpu_ms_per_token"].get(p, 0.0) for r in rows), 3)
                               for p in sorted(procs)}
    return out


def table(results: dict, reference: str = "vllm") -> str:
    """Markdown: per concurrency and server, medians, every run's tok/s, and each ÷ the reference server's."""
    lines = [f"| concurrency | server | output tok/s (median) | runs | ÷ {reference} | mean TTFT ms | mean TPOT ms | "
             "CPU ms/token by process |", "|---:|---|---:|---|---:|---:|---:|---|"]
    for c in next(iter(results.values())):
        ref = median_row(results[reference][c])["output_throughput"] if reference in results else None
        for server, by_c in results.items():
            m = median_row(by_c[c])
            ratio = f"{m['output_throughput'] / ref:.2f}" if ref else "-"
            cpu = ", ".join(f"{k} {v:.2f}" for k, v in m["cpu_ms_per_token"].items())
            lines.append(f"| {c} | {server} | {m['output_throughput']:,.0f} | "
                         f"{' / '.join(f'{x:,.0f}' for x in m['output_throughput_all'])} | {ratio} | "
                         f"{m['mean_ttft_ms']:.0f} | {m['mean_tpot_ms']:.1f} | {cpu} |")
    lines += ["", "Thread settings:"] + [f"- {s}: {THREADS[s]}" for s in results]
    return "\n".join(lines)


def checkpoint_dir(model: str) -> str:
    """--model as the directory both servers are given (gpt2-shaped built first); exits with one line if it
    holds no checkpoint, before any server starts."""
    path = resolve_model(model)
    if not os.path.isfile(os.path.join(path, "config.json")):
        sys.exit(f"--model {model}: no checkpoint there (no config.json); give a checkpoint directory or {GPT2_SHAPED}")
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vllm-bin", default=str(ROOT / ".venv-vllm" / "bin"), help="where `vllm` is (make parity)")
    ap.add_argument("--model", default=str(ROOT / "engine" / "builtin" / "tiny-gpt2"),
                    help=f"checkpoint directory, or {GPT2_SHAPED} (GPT-2 small's size, random weights, built locally)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--servers", nargs="+", default=["vllm", "ours"], choices=list(VARIANTS))
    ap.add_argument("--reference", default="vllm", choices=list(VARIANTS),
                    help="the server the ratio column divides by (ours, with ours-async: async scheduling's gain)")
    ap.add_argument("--prompts-per-stream", type=int, default=PROMPTS_PER_STREAM, metavar="N",
                    help="prompts a run sends per stream, 16 at least (default 2: two waves; 8: mostly decoding)")
    ap.add_argument("--json", metavar="PATH", help="also write every run's numbers here")
    a = ap.parse_args()
    if a.prompts_per_stream < 1:
        ap.error(f"--prompts-per-stream must be >= 1, got {a.prompts_per_stream}")
    if not os.path.exists(os.path.join(a.vllm_bin, "vllm")):
        sys.exit(f"no vllm in {a.vllm_bin}: run `make parity-setup` first")
    a.model = checkpoint_dir(a.model)
    with tempfile.TemporaryDirectory(prefix="vllm-trace-serving-") as d:
        results = run(a.vllm_bin, a.model, a.concurrency, a.reps, a.servers, Path(d), a.prompts_per_stream)
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    print(table(results, a.reference))


if __name__ == "__main__":
    main()
