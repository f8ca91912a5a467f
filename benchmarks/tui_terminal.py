"""The TUI's cost in a real terminal: `vllm-trace serve` with its TUI drawing into a tmux pane
(160x48, the Requests panel shown) against `serve --no-tui` (tracing on, as `serve` traces by
default) and `serve --no-tui --no-trace`, all with the engine core in its own process, answering
the same 64 streaming HTTP clients. The targets (tokens per wall second):

    tui / traced >= 0.90: the TUI on / off, everything else equal
    traced / off >= 0.90: tracing on / off
    >= 10 refreshes/s while requests are in flight

It also prints tui / off: the TUI and the tracing it cannot run without, together.

    python -m benchmarks.tui_terminal [--reps 5] [--requests 64]

The three servers stay up for the whole run and take turns (the order rotates each repetition).
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
    return {"API server + TUI": serve, "core (TUI server)": children(serve, "engine.engine.core_proc")[0],
            "tmux": int(tmux("display-message", "-p", "#{pid}").strip())}


MODES = {"off": "serve --no-tui --no-trace", "traced": "serve --no-tui", "tui": "serve (TUI)"}


def cpu_budget(cpu: dict[str, float], tokens: dict[str, int], wall: dict[str, float], base: str,
               target: float = 0.90) -> str:
    """The CPU the machine spent per token in each mode (the servers, their cores, tmux and the
    clients in this process), and what the target leaves the TUI when the machine is CPU-bound:
    then tokens/s is cores / (CPU per token), so tui / base >= target needs the TUI's extra CPU
    per token to stay under (1/target - 1) x base's."""
    per = {m: cpu[m] / tokens[m] * 1e6 for m in cpu}
    busy = {m: cpu[m] / wall[m] for m in cpu}
    extra, budget = per["tui"] - per[base], (1 / target - 1) * per[base]
    return ("  machine CPU per token (servers, cores, tmux, clients): "
            + ", ".join(f"{m} {per[m]:.0f} us" for m in per) + "; cores busy: "
            + ", ".join(f"{m} {busy[m]:.2f}" for m in busy) + f" of {os.cpu_count()}\n"
            f"  the TUI's extra CPU per token over {base}: {extra:.0f} us; a CPU-bound machine reaches {target} with "
            f"at most {budget:.0f} us")


def ratio(rates: dict[str, list[float]], a: str, b: str) -> float:
    return statistics.median(x / y for x, y in zip(rates[a], rates[b]))


async def run(args) -> None:
    workload = make_workload(args.requests, output_len=(args.min_tokens, args.max_tokens))
    off_proc, off_url, off_core = spawn_serve(args.model, args.threads)
    traced_proc, traced_url, traced_core = spawn_serve(args.model, args.threads, trace=True)
    rates: dict[str, list[float]] = {mode: [] for mode in MODES}
    try:
        urls = {"off": off_url, "traced": traced_url, "tui": start_tui_server(args.model, args.threads)}
        for url in urls.values():  # warm-up: first requests, the app's first busy redraws
            await http_run(url, args.model, make_workload(8))
        pids = tui_pids()
        pids |= {"API server, no TUI": traced_proc.pid, "core (no TUI, traced)": traced_core,
                 "API server, untraced": off_proc.pid, "core (untraced)": off_core}
        cpu = {name: 0.0 for name in pids}
        mode_cpu, mode_tokens, mode_wall = ({m: 0.0 for m in MODES}, {m: 0 for m in MODES}, {m: 0.0 for m in MODES})
        # each API server's main thread (its event loop: HTTP, and the TUI's refreshes), in its own mode's reps
        loop_pid = {"off": off_proc.pid, "traced": traced_proc.pid, "tui": pids["API server + TUI"]}
        loop_cpu = {m: 0.0 for m in MODES}
        order = list(MODES)
        for rep in range(args.reps):
            for mode in order[rep % 3:] + order[:rep % 3]:  # each mode first, second and third in turn
                if mode == "tui":
                    tmux("send-keys", "-t", SESSION, "2")  # the Requests panel, chosen (the app won't switch away)
                    await asyncio.sleep(0.5)
                c0 = {name: proc_cpu(pid) for name, pid in pids.items()}
                loop0 = proc_cpu(loop_pid[mode], loop_pid[mode])
                t0, clients0 = time.perf_counter(), time.process_time()
                tokens = await http_run(urls[mode], args.model, workload)
                if tokens == 0:
                    raise RuntimeError("the server generated no tokens: do --max-tokens and the prompts (up to 96 "
                                       "tokens) fit the model's context?")
                seconds = time.perf_counter() - t0
                loop_cpu[mode] += proc_cpu(loop_pid[mode], loop_pid[mode]) - loop0
                rates[mode].append(tokens / seconds)
                used = {name: proc_cpu(pid) - c0[name] for name, pid in pids.items()}
                for name in pids:
                    cpu[name] += used[name]
                mode_cpu[mode] += sum(used.values()) + time.process_time() - clients0  # (the idle servers' too)
                mode_tokens[mode] += tokens
                mode_wall[mode] += seconds
                print(f"rep {rep} {mode:>6}: {rates[mode][-1]:8.1f} tokens/s ({tokens} tokens)", flush=True)
        summary = quit_tui_server()
    finally:
        for proc in (off_proc, traced_proc):
            proc.terminate()
            proc.wait(30)
        subprocess.run(["tmux", "-L", SOCKET, "kill-server"], capture_output=True)
    m = re.search(r"TUI: ([\d.]+) refreshes/s while requests were in flight \((\d+) in ([\d.]+) s\)", summary)
    print(f"\n{args.requests} streaming HTTP clients, {args.reps} repetitions, engine core in its own process, "
          f"the TUI in a {160}x{48} tmux pane on its Requests panel; modes: "
          + ", ".join(f"{m} = {what}" for m, what in MODES.items()))
    print("median tokens/s: " + ", ".join(f"{m} {statistics.median(r):.1f}" for m, r in rates.items()))
    print("  medians of per-repetition ratios:")
    print(f"  tui / traced = {ratio(rates, 'tui', 'traced'):.3f}   the TUI on / off, tracing on in both, as `serve` "
          f"against `serve --no-tui` (target >= 0.90)")
    print(f"  traced / off = {ratio(rates, 'traced', 'off'):.3f}   tracing on / off, no TUI (target >= 0.90)")
    print(f"  tui / off    = {ratio(rates, 'tui', 'off'):.3f}   both together: the TUI and the tracing it needs")
    print("  CPU seconds over all repetitions: " + ", ".join(f"{name} {sec:.2f}" for name, sec in cpu.items()))
    print(cpu_budget(mode_cpu, mode_tokens, mode_wall, base="traced"))
    loop = {mode: loop_cpu[mode] / mode_tokens[mode] * 1e6 for mode in loop_cpu}
    line = ("  the API server's event loop (main thread), CPU per token: "
            + ", ".join(f"{mode} {us:.0f} us" for mode, us in loop.items()))
    if m:
        refreshes = float(m.group(1)) * mode_wall["tui"]  # (the rate is the TUI's own count while busy)
        share = loop_cpu["tui"] - loop_cpu["off"] * mode_tokens["tui"] / mode_tokens["off"]
        line += f"; the TUI's share (tui - off): {share / refreshes * 1e3:.1f} ms a refresh"
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
