"""A recorded trace for replay tests and snapshots: a real engine run (Triton kernels, through
the interpreter on the CPU) that preempts, hits the prefix cache and chunks a prefill, made
deterministic afterwards: timestamps, durations and paths are the only things that vary
between runs, so they are replaced by fixed functions of the event."""
from __future__ import annotations

import json
from pathlib import Path

from engine import LLM, Hooks, SamplingParams
from tracer.session import TraceSession

SHARED = "A shared prefix, a shared prefix! "
# The byte-level random model: the prompts were sized in bytes to make this run preempt, share prefix
# blocks and chunk a prefill; the TUI's panels do not depend on what the text says.
MODEL = "tiny-gpt2-random"
PROMPTS = {"req-0": SHARED + "one", "req-1": SHARED + "two", "req-2": "Hello there", "req-3": "x" * 30}


def record(path: Path) -> Path:
    raw = path.with_suffix(".raw.jsonl")
    hooks = Hooks()
    session = TraceSession(hooks, trace_file=raw, control=False, model=MODEL)
    # synchronous: under async scheduling the executor thread's events interleave with the core's in an
    # order that varies from run to run, and the snapshots need one order
    llm = LLM(MODEL, hooks=hooks, block_size=4, num_kv_blocks=25, max_num_batched_tokens=24,
              attention_backend="triton", device="cpu", async_scheduling=False)
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
    session.close()
    _normalise(raw, path)
    return path


def _normalise(src: Path, dst: Path) -> None:
    lines = src.read_text().splitlines()
    header = json.loads(lines[0])
    header.update(wall_clock_start_ns=0, wall_clock_start="2025-01-01T00:00:00Z", perf_counter_start_ns=0)
    out = [json.dumps(header)]
    for line in lines[1:]:
        ev = json.loads(line)
        ev["ts_ns"] = ev["seq"] * 250_000  # a quarter of a millisecond per event
        a = ev["attrs"] or {}
        if "duration_ns" in a:
            a["duration_ns"] = 10_000 * (1 + (a.get("layer_idx") or 0)) + 1_000 * len(ev["name"]) + 100 * ev["step"]
        if "seconds" in a:
            a["seconds"] = 0.001 * (1 + ev["seq"] % 7)
        if "path" in a:
            a["path"] = "<model cache>/tiny-gpt2"
        out.append(json.dumps(ev))
    dst.write_text("\n".join(out) + "\n")
