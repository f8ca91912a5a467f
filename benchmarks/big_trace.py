"""A trace file of any size, made of a real recording: what `export` and `replay` are measured on.

    python -m benchmarks.big_trace OUT.jsonl [--mb 100]

The source is a short traced run of the built-in tiny-gpt2 (16 requests, preemption included).
Its events from the first request on are then repeated until the file reaches the size asked
for, each copy shifted past the one before: sequence numbers, times and steps, and request ids
renamed (``R`` becomes ``R.k``, wherever an event names it), so the result reads as one long run
of distinct requests and steps.
"""
from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parents[1]


def record_source(path: Path) -> None:
    from engine import LLM, Hooks, SamplingParams
    from tracer.session import TraceSession

    hooks = Hooks()
    with TraceSession(hooks, trace_file=path, control=False, model="tiny-gpt2"):
        llm = LLM("tiny-gpt2", hooks=hooks, num_kv_blocks=24, max_num_batched_tokens=128)
        prompts = [f"Once upon a time there was a number {i} that" for i in range(16)]
        llm.generate(prompts, SamplingParams(max_tokens=48, temperature=0, ignore_eos=True), use_tqdm=False)


def _rename(x, ids: dict[str, str]):
    if isinstance(x, str):
        return ids.get(x, x)
    if isinstance(x, list):
        return [_rename(v, ids) for v in x]
    if isinstance(x, dict):
        return {ids.get(k, k): _rename(v, ids) for k, v in x.items()}
    return x


def inflate(source: Path, out: Path, target_bytes: int) -> tuple[int, int]:
    """Write `out`: source's header, then copies of its request events up to target_bytes.
    Returns (events, bytes) written."""
    lines = source.read_bytes().splitlines()
    header, events = lines[0], [orjson.loads(line) for line in lines[1:]]
    first = next(i for i, e in enumerate(events) if e["layer"] == "engine" and e["name"] == "QUEUED")
    body = events[first:]
    rids = sorted({e["request_id"] for e in body if e["request_id"] is not None})
    seq_span = body[-1]["seq"] - body[0]["seq"] + 1
    ts_span = body[-1]["ts_ns"] - body[0]["ts_ns"] + 1_000_000
    steps = [e["step"] for e in body if e["step"] is not None]
    step_span = max(steps) - min(steps) + 1
    n, size = 0, len(header) + 1
    with open(out, "wb") as f:
        f.write(header + b"\n")
        for k in range(1_000_000):
            ids = {r: f"{r}.{k}" for r in rids}
            chunk = []
            for e in body:
                e = dict(e, seq=e["seq"] + k * seq_span, ts_ns=e["ts_ns"] + k * ts_span,
                         request_id=ids.get(e["request_id"], e["request_id"]),
                         step=None if e["step"] is None else e["step"] + k * step_span,
                         attrs=_rename(e["attrs"], ids))
                chunk.append(orjson.dumps(e, option=orjson.OPT_APPEND_NEWLINE))
            data = b"".join(chunk)
            f.write(data)
            n, size = n + len(chunk), size + len(data)
            if size >= target_bytes:
                break
    return n, size


def make(out: Path, megabytes: float) -> tuple[int, int]:
    with tempfile.TemporaryDirectory() as d:
        source = Path(d) / "source.jsonl"
        record_source(source)
        return inflate(source, out, int(megabytes * 1024 * 1024))


# The child's own peak: VmHWM belongs to its address space. (getrusage's ru_maxrss does not: Linux
# carries the high-water mark across fork and exec, so a child of a big process reports the parent's.)
_PEAK = "print('peak_rss_kib=' + next(l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM')))"


def run_measured(code: str, *args: str, timeout: float = 600) -> tuple[float, subprocess.CompletedProcess]:
    """Run Python `code` (argv: args) in a fresh interpreter; its peak RSS (MiB) and what it printed."""
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    script = f"import sys\ntry:\n    {code}\nfinally:\n    sys.stdout.flush(); {_PEAK}"
    proc = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=ROOT)
    kib = next((int(line.split("=")[1]) for line in proc.stdout.splitlines() if line.startswith("peak_rss_kib=")), 0)
    return kib / 1024, proc


def peak_rss_mib(*cli_args: str, timeout: float = 600) -> tuple[float, subprocess.CompletedProcess]:
    """`vllm-trace ARGS` in a fresh interpreter: its peak RSS (MiB) and what it printed."""
    return run_measured("from tracer.cli import main; sys.exit(main(sys.argv[1:]))", *cli_args, timeout=timeout)


REPLAY_MOVES = ("from tracer.replay import Replay; r = Replay.load(sys.argv[1]); r.goto(r.steps[len(r.steps) // 2]); "
                "r.final(); r.prev(); r.goto(r.steps[0]); r.next()")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="the trace file to write")
    p.add_argument("--mb", type=float, default=100.0, help="its size in MiB (default 100)")
    args = p.parse_args(argv)
    n, size = make(Path(args.out), args.mb)
    print(f"{args.out}: {n} events, {size / 2 ** 20:.1f} MiB "
          f"(this process: peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
