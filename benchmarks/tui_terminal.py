"""The TUI's cost in a real terminal: `vllm-trace serve` with its TUI drawing into a tmux pane
(160x48, the Requests panel shown) against `serve --no-tui --no-trace`, both with the engine
core in its own process, answering the same 64 streaming HTTP clients. Issue 15's target:

    tui / off >= 0.90 (tokens per wall second), and >= 10 refreshes/s while requests are in flight

    python -m benchmarks.tui_terminal [--reps 5] [--requests 64]

The two servers stay up for the whole run and take turns (the order rotates each repetition).
Before each TUI repetition the benchmark presses `2` in the pane, as a user would, so the
Requests panel is the one drawing. The refresh rate is the TUI's own count, printed by `serve`
when it quits (`q`): refreshes per second of the time requests were in flight. The clients run
in this process on the same two cores, as in benchmarks.two_processes (whose helpers it uses).
Needs tmux.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from benchmarks.two_processes import http_run, proc_cpu, spawn_serve
from benchmarks.workload import make_workload, resolve_model

ROOT = Path(__file__).resolve().parents[1]
SOCKET = f"vllm-trace-bench-{os.getpid()}"
SESSION = "bench"


def tmux(*args: str) -> str:
    return subprocess.run(["tmux", "-L", SOCKET, *args], check=True, capture_output=True, text=True).stdout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_tui_server(model: str, threads: int, width: int = 160, height: int = 48) -> str:
    """serve with its TUI in a detached tmux pane; returns its URL once /health answers."""
    port = free_port()
    env = (f"env -u COLUMNS -u LINES TERM=xterm-256color PYTHONPATH={ROOT} OMP_NUM_THREADS={threads}")
    command = f"cd {ROOT} && {env} {sys.executable} -m tracer.cli serve {model} --port {port}; sleep 600"
    tmux("new-session", "-d", "-s", SESSION, "-x", str(width), "-y", str(height), command)
    tmux("set-option", "-t", SESSION, "window-size", "manual")  # no client attached: keep the size
    tmux("resize-window", "-t", f"{SESSION}:0", "-x", str(width), "-y", str(height))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)  # another process is starting: nothing to wait on here
    raise RuntimeError("the TUI server did not become ready in 120 s:\n" + tmux("capture-pane", "-p", "-t", SESSION))


def quit_tui_server() -> str:
    """Press q and return the summary serve prints once the TUI has given the terminal back."""
    tmux("send-keys", "-t", SESSION, "q")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        text = tmux("capture-pane", "-p", "-t", SESSION, "-S", "-200")
        if re.search(r"requests? served|requests finished in", text):
            return text
        time.sleep(0.2)
    raise RuntimeError("serve did not print its summary after q:\n" + text)


def children(pid: int, pattern: str = "") -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid), *(["-f", pattern] if pattern else [])], capture_output=True,
                         text=True).stdout
    return [int(p) for p in out.split()]


def tui_pids() -> dict[str, int]:
    """The TUI server's API-server process (the pane's shell's child), its engine core, and the
    tmux server, which parses everything the TUI draws."""
    shell = int(tmux("display-message", "-p", "-t", SESSION, "#{pane_pid}").strip())
    serve = children(shell)[0]
    return {"API server + TUI": serve, "core (traced)": children(serve, "engine.core_proc")[0],
            "tmux": int(tmux("display-message", "-p", "#{pid}").strip())}


def cpu_budget(cpu: dict[str, float], tokens: dict[str, int], wall: dict[str, float], target: float = 0.90) -> str:
    """The CPU the machine spent per token in each mode (the servers, their cores, tmux and the
    clients in this process), and what the target leaves the TUI when the machine is CPU-bound:
    then tokens/s is cores / (CPU per token), so tui / off >= target needs the TUI's extra CPU
    per token to stay under (1/target - 1) x off's."""
    per = {m: cpu[m] / tokens[m] * 1e6 for m in cpu}
    busy = {m: cpu[m] / wall[m] for m in cpu}
    extra, budget = per["tui"] - per["off"], (1 / target - 1) * per["off"]
    return (f"  machine CPU per token (servers, cores, tmux, clients): off {per['off']:.0f} us, tui {per['tui']:.0f} "
            f"us; cores busy: off {busy['off']:.2f}, tui {busy['tui']:.2f} of {os.cpu_count()}\n"
            f"  the TUI mode's extra CPU per token: {extra:.0f} us; a CPU-bound machine reaches {target} with at most "
            f"{budget:.0f} us")


async def run(args) -> None:
    workload = make_workload(args.requests, output_len=(args.min_tokens, args.max_tokens))
    off_proc, off_url, off_core = spawn_serve(args.model, args.threads)
    rates: dict[str, list[float]] = {"off": [], "tui": []}
    try:
        tui_url = start_tui_server(args.model, args.threads)
        for url in (off_url, tui_url):  # warm-up: first requests, the app's first busy redraws
            await http_run(url, args.model, make_workload(8))
        pids = tui_pids()
        pids |= {"API server, no TUI": off_proc.pid, "core (untraced)": off_core}
        cpu = {name: 0.0 for name in pids}
        mode_cpu, mode_tokens, mode_wall = {"off": 0.0, "tui": 0.0}, {"off": 0, "tui": 0}, {"off": 0.0, "tui": 0.0}
        # each API server's main thread (its event loop: HTTP, and the TUI's refreshes), in its own mode's reps
        loop_pid, loop_cpu = {"off": off_proc.pid, "tui": pids["API server + TUI"]}, {"off": 0.0, "tui": 0.0}
        for rep in range(args.reps):
            for mode in (["off", "tui"] if rep % 2 == 0 else ["tui", "off"]):
                if mode == "tui":
                    tmux("send-keys", "-t", SESSION, "2")  # the Requests panel, chosen (the app won't switch away)
                    await asyncio.sleep(0.5)
                c0 = {name: proc_cpu(pid) for name, pid in pids.items()}
                loop0 = proc_cpu(loop_pid[mode], loop_pid[mode])
                t0, clients0 = time.perf_counter(), time.process_time()
                tokens = await http_run(tui_url if mode == "tui" else off_url, args.model, workload)
                if tokens == 0:
                    raise RuntimeError("the server generated no tokens: do --max-tokens and the prompts (up to 96 "
                                       "tokens) fit the model's context?")
                seconds = time.perf_counter() - t0
                loop_cpu[mode] += proc_cpu(loop_pid[mode], loop_pid[mode]) - loop0
                rates[mode].append(tokens / seconds)
                used = {name: proc_cpu(pid) - c0[name] for name, pid in pids.items()}
                for name in pids:
                    cpu[name] += used[name]
                mode_cpu[mode] += sum(used.values()) + time.process_time() - clients0  # (the idle server's too)
                mode_tokens[mode] += tokens
                mode_wall[mode] += seconds
                print(f"rep {rep} {mode:>3}: {rates[mode][-1]:8.1f} tokens/s ({tokens} tokens)", flush=True)
        summary = quit_tui_server()
    finally:
        off_proc.terminate()
        off_proc.wait(30)
        subprocess.run(["tmux", "-L", SOCKET, "kill-server"], capture_output=True)
    ratio = statistics.median(t / o for t, o in zip(rates["tui"], rates["off"]))
    m = re.search(r"TUI: ([\d.]+) refreshes/s while requests were in flight \((\d+) in ([\d.]+) s\)", summary)
    print(f"\n{args.requests} streaming HTTP clients, {args.reps} repetitions, engine core in its own process, "
          f"the TUI in a {160}x{48} tmux pane on its Requests panel")
    print(f"median tokens/s: off {statistics.median(rates['off']):.1f}, tui {statistics.median(rates['tui']):.1f}")
    print(f"  tui / off (median of per-repetition ratios) = {ratio:.3f}   (target >= 0.90)")
    print("  CPU seconds over all repetitions: " + ", ".join(f"{name} {sec:.2f}" for name, sec in cpu.items()))
    print(cpu_budget(mode_cpu, mode_tokens, mode_wall))
    loop = {mode: loop_cpu[mode] / mode_tokens[mode] * 1e6 for mode in loop_cpu}
    line = (f"  the API server's event loop (main thread), CPU per token: {loop['tui']:.0f} us with the TUI, "
            f"{loop['off']:.0f} us without")
    if m:
        refreshes = float(m.group(1)) * mode_wall["tui"]  # (the rate is the TUI's own count while busy)
        share = loop_cpu["tui"] - loop_cpu["off"] * mode_tokens["tui"] / mode_tokens["off"]
        line += f"; the TUI's share: {share / refreshes * 1e3:.1f} ms a refresh"
    print(line)
    if m:
        print(f"  TUI refreshes/s while requests were in flight: {m.group(1)} ({m.group(2)} refreshes in "
              f"{m.group(3)} s, warm-up included)   (target >= 10)")
    else:
        print("  (serve printed no refresh rate: its summary was)\n" + summary)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-gpt2")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--min-tokens", type=int, default=32, help="output tokens per request, at least")
    ap.add_argument("--max-tokens", type=int, default=64, help="output tokens per request, at most")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads, in every process")
    args = ap.parse_args()
    if shutil.which("tmux") is None:
        sys.exit("benchmarks.tui_terminal needs tmux (apt-get install -y tmux)")
    if args.requests < 1 or args.reps < 1 or args.threads < 1:
        ap.error("--requests, --reps and --threads must be >= 1")
    if not 1 <= args.min_tokens <= args.max_tokens:
        ap.error("need 1 <= --min-tokens <= --max-tokens")
    args.model = resolve_model(args.model)
    try:
        asyncio.run(run(args))
    except RuntimeError as e:
        sys.exit(f"benchmarks.tui_terminal: {e}")


if __name__ == "__main__":
    main()
