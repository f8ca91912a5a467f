"""What the process split costs and buys: the issue-15 targets, measured side by side in one run.

    python -m benchmarks.two_processes [--requests 64] [--reps 3] [--threads 1]

Part 1, the engine core in its own process (AsyncLLM), 64 concurrent streaming requests
consumed on this process's asyncio loop, as the server's SSE handlers do; three engine
cores kept up for the whole run and used in turn, repetitions interleaved:

  off      no tracer (serve --no-tui --no-trace)
  traced   a TraceSession (bus, remote step controller, no trace file): the core ships its events
  tui      + the Textual app (headless, 160x48) on the same loop, the chosen pane visible

  targets: traced / off >= 0.90, tui / off >= 0.90 (tokens per wall second), >= 10 refreshes/s

Part 2, CPU seconds per output token, offline `LLM.generate` (in this process, its engine on
a thread of its own as under serve) against `vllm-trace serve --no-tui --no-trace` (a
subprocess: the API server and its engine core, CPU read from /proc for both) answering 64
streaming HTTP clients that run here, same workload. target: offline / serve >= 0.85
(CPU per token; higher means serve costs less extra). The same server with
--no-multiprocessing is measured beside it: what the process boundary itself costs. The clients
compete for the same cores: wall-clock tokens/s of both are printed too.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from benchmarks.workload import make_workload, resolve_model
from engine import LLM, Hooks
from engine.arg_utils import engine_config
from engine.engine.async_llm import AsyncLLM
from engine.gc_utils import freeze_gc_heap
from tracer.session import TraceSession
from tracer.tui.measure import stream_load

MODES = ["off", "traced", "tui"]
ROOT = Path(__file__).resolve().parents[1]


class Core:
    """One engine core process for one mode, kept up across repetitions."""

    def __init__(self, mode: str, model: str):
        self.mode, self.hooks = mode, Hooks()
        self.session = TraceSession(self.hooks, model=model, remote_control=True) if mode != "off" else None
        options = self.session.core_options() if self.session else None
        self.llm = AsyncLLM(engine_config(model), self.hooks, drain_timeout=0, core_options=options).start()
        if self.session:
            self.session.bind(self.llm)
        self.runs = 0

    async def run(self, workload, pane: str) -> dict:
        core0 = proc_cpu(self.llm.core_pid)
        r = await stream_load(self.llm, workload, self.session, self.mode == "tui", pane, model="bench")
        return {"tokens": r.tokens, "seconds": r.seconds, "cpu": r.cpu, "core_cpu": proc_cpu(self.llm.core_pid) - core0,
                "refresh_hz": r.refresh_hz}

    def close(self) -> None:
        self.llm.stop(0)
        if self.session:
            self.session.close()


def proc_cpu(pid: int, tid: int | None = None) -> float:
    """CPU seconds (user + system) a process (or one of its threads: tid) has used, from /proc."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    fields = Path(path).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def part1(args, workload) -> None:
    cores = {m: Core(m, args.model) for m in MODES}  # launched from this (the main) thread
    try:
        for core in cores.values():  # warm-up: first-use costs, CSS
            await core.run(make_workload(4), args.pane)
        freeze_gc_heap()  # as serve's front end does once it is up
        results: dict[str, list[dict]] = {m: [] for m in MODES}
        for rep in range(args.reps):
            order = MODES[rep % len(MODES):] + MODES[:rep % len(MODES)]  # rotate who goes first
            for mode in order:
                r = await cores[mode].run(workload, args.pane)
                results[mode].append(r)
                hz = f", {r['refresh_hz']:.1f} refreshes/s" if r["refresh_hz"] is not None else ""
                print(f"rep {rep} {mode:>6}: {r['tokens'] / r['seconds']:8.1f} tokens/s ({r['tokens']} tokens, "
                      f"{r['seconds']:.2f} s; CPU: front end {r['cpu']:.2f} s, core {r['core_cpu']:.2f} s{hz})",
                      flush=True)
    finally:
        for core in cores.values():
            core.close()
    rate = {m: [r["tokens"] / r["seconds"] for r in results[m]] for m in MODES}
    print(f"\npart 1: {args.requests} streaming requests, engine core in its own process, {args.reps} interleaved reps")
    print("median tokens/s: " + ", ".join(f"{m} {statistics.median(v):.1f}" for m, v in rate.items()))
    for a, target in (("traced", 0.90), ("tui", 0.90)):
        paired = statistics.median(x / y for x, y in zip(rate[a], rate["off"]))
        print(f"  {a} / off (median of per-repetition ratios) = {paired:.3f}   (target >= {target})")
    hz = [r["refresh_hz"] for r in results["tui"]]
    print(f"  TUI refreshes/s during the runs: median {statistics.median(hz):.1f}, min {min(hz):.1f} (target >= 10)")


def spawn_serve(model: str, threads: int, *flags: str, trace: bool = False) -> tuple[subprocess.Popen, str, int | None]:
    """serve --no-tui (and --no-trace unless trace): its process, URL and engine core's pid."""
    env = os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.Popen([sys.executable, "-m", "tracer.cli", "serve", model, "--port", "0", "--no-tui",
                             *([] if trace else ["--no-trace"]), *flags], cwd=ROOT, stderr=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, text=True, env=env)
    core = None
    for line in proc.stderr:
        m = re.search(r"engine core pid (\d+)", line)
        core = int(m.group(1)) if m else core
        if line.startswith("Ready:"):
            threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep its pipe drained
            return proc, re.search(r"at (http://\S+)", line).group(1), core
    raise RuntimeError("serve exited before its ready line")


async def http_run(url: str, model: str, workload) -> int:
    import httpx

    async def one(client, prompt, params) -> int:
        body = {"model": model, "prompt": prompt, "max_tokens": params.max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        n = 0
        async with client.stream("POST", "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {") and '"usage":{' in line.replace(" ", ""):
                    m = re.search(r'"completion_tokens":\s*(\d+)', line)
                    n = int(m.group(1)) if m else n
        return n
    limits = httpx.Limits(max_connections=len(workload) + 8)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        return sum(await asyncio.gather(*(one(client, p, s) for p, s in workload)))


def offline_run(model: str, workload, llm: LLM) -> dict:
    out: dict = {}

    def go() -> None:  # the engine on a thread of its own, as under serve
        t0, c0 = time.perf_counter(), time.process_time()
        outs = llm.generate([{"prompt_token_ids": p} for p, _ in workload], [s for _, s in workload], use_tqdm=False)
        out.update(seconds=time.perf_counter() - t0, cpu=time.process_time() - c0,
                   tokens=sum(len(o.outputs[0].token_ids) for o in outs))
    t = threading.Thread(target=go)
    t.start()
    t.join()
    return out


async def part2(args, workload) -> None:
    llm = LLM(args.model)
    offline_run(args.model, make_workload(4), llm)  # warm-up
    servers = {"two processes": spawn_serve(args.model, args.threads),
               "one process": spawn_serve(args.model, args.threads, "--no-multiprocessing")}
    ratios: dict[str, list[float]] = {mode: [] for mode in servers}
    try:
        for proc, url, _ in servers.values():
            await http_run(url, args.model, make_workload(4))  # warm-up
        for rep in range(args.reps):
            off = offline_run(args.model, workload, llm)
            per_off = off["cpu"] / off["tokens"]
            line = (f"rep {rep}: offline {off['tokens'] / off['seconds']:7.1f} tokens/s, "
                    f"{per_off * 1e3:.3f} CPU-ms/token")
            for mode, (proc, url, core) in servers.items():
                cpu0 = [proc_cpu(pid) for pid in (proc.pid, core) if pid]
                t0 = time.perf_counter()
                tokens = await http_run(url, args.model, workload)
                seconds = time.perf_counter() - t0
                used = [proc_cpu(pid) - c for pid, c in zip([pid for pid in (proc.pid, core) if pid], cpu0)]
                per_serve = sum(used) / tokens
                ratios[mode].append(per_off / per_serve)
                split = f"API server {used[0]:.2f} s + core {used[1]:.2f} s" if len(used) == 2 else f"{used[0]:.2f} s"
                line += (f" | serve, {mode}: {tokens / seconds:7.1f} tokens/s, {per_serve * 1e3:.3f} CPU-ms/token "
                         f"({split}), ratio {per_off / per_serve:.3f}")
            print(line, flush=True)
    finally:
        for proc, _, _ in servers.values():
            proc.terminate()
            proc.wait(30)
    print(f"\npart 2: CPU per output token, offline LLM.generate / serve, {args.requests} streaming HTTP clients:")
    for mode, values in ratios.items():
        target = ("   (target >= 0.85)" if mode == "two processes"
                  else "   (for comparison: the same server, one process)")
        print(f"  {mode:<14} median {statistics.median(values):.3f}{target}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-gpt2")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--min-tokens", type=int, default=32, help="output tokens per request, at least")
    ap.add_argument("--max-tokens", type=int, default=64, help="output tokens per request, at most")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads, in every process")
    ap.add_argument("--pane", default="requests", choices=["startup", "requests", "kv", "step", "kernels", "log"])
    ap.add_argument("--part", type=int, choices=[1, 2], default=None, help="run only this part")
    args = ap.parse_args()
    if args.requests < 1 or args.reps < 1 or args.threads < 1:
        ap.error("--requests, --reps and --threads must be >= 1")
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the engine cores this starts inherit it
    torch.set_num_threads(args.threads)
    args.model = resolve_model(args.model)
    workload = make_workload(args.requests, output_len=(args.min_tokens, args.max_tokens))
    print(f"model {args.model}, {args.requests} requests of {args.min_tokens}-{args.max_tokens} output tokens, "
          f"{args.threads} torch thread(s) per process", flush=True)
    if args.part in (None, 1):
        asyncio.run(part1(args, workload))
    if args.part in (None, 2):
        asyncio.run(part2(args, workload))


if __name__ == "__main__":
    main()
