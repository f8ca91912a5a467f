"""Benchmark the Triton kernels against their PyTorch references.

    python benchmarks/kernels.py            # prints a table, rewrites the "Kernels" section of
                                            # benchmarks/RESULTS.md
On CUDA it also reports the decode kernel's achieved memory bandwidth as a fraction of the
device's peak; on the CPU (Triton interpreter) the time per launch and per simulated engine
step (4 layers x (cache write + attention)). Sized to finish in well under 2 minutes on 2 cores.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

# The repository root first: this file is itself named kernels.py, and the script's own folder
# (sys.path[0]) would otherwise shadow the kernels package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

# isort: off
import kernels  # first: it sets TRITON_INTERPRET before triton decorates anything
import triton
# isort: on
from kernels import instrument

DEVICE = "cuda" if torch.cuda.is_available() and not kernels.INTERPRETED else "cpu"
# Peak DRAM bandwidth in GB/s, by substring of torch.cuda.get_device_name().
PEAK_GBPS = {
    "H200": 4800, "H100 NVL": 3900, "H100 PCIe": 2000, "H100": 3350, "A100-SXM4-80GB": 2039,
    "A100-PCIE-80GB": 1935, "A100": 1555, "L40S": 864, "L4": 300, "A10G": 600, "RTX 4090": 1008, "T4": 320,
}
# The built-in model: 4 layers, 4 heads of 32, block size 16.
LAYERS, HEADS, HEAD_SIZE, BLOCK = 4, 4, 32, 16

# name, query lens, seq lens (every shape uses the model's heads and block size)
SHAPES = [
    ("decode 8 x 64 (model step)", [1] * 8, [64] * 8),
    ("decode 32 x 256", [1] * 32, [256] * 32),
    ("decode 4 x 1024", [1] * 4, [1024] * 4),
    ("prefill 2 x 64", [64, 64], [64, 64]),
    ("mixed 4 decode@128 + chunk 32@96", [1, 1, 1, 1, 32], [128, 128, 128, 128, 128]),
]
if DEVICE == "cuda":  # sizes where bandwidth, not launch overhead, is measured
    SHAPES += [("decode 64 x 2048", [1] * 64, [2048] * 64), ("decode 256 x 4096", [1] * 256, [4096] * 256)]


def device_name() -> str:
    if DEVICE == "cuda":
        return torch.cuda.get_device_name()
    load = os.getloadavg()[0]
    return (f"CPU ({os.cpu_count()} cores, load average {load:.1f} when the run started: wall-clock "
            f"times are inflated by other processes, CPU times are not), Triton {triton.__version__} interpreter")


def timeit(fn, reps: int, cpu_time: bool = False) -> float:
    """Fastest of `reps` calls after one warm-up, in seconds (wall clock, or process CPU time).

    The minimum, not the median: on a shared machine other processes only ever add time, so
    the fastest run is the best estimate of the kernel's own cost. CPU time (meaningful on the
    CPU only) is not inflated by other processes at all.
    """
    clock = time.process_time if cpu_time else time.perf_counter
    fn()
    times = []
    for _ in range(reps):
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        t0 = clock()
        fn()
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        times.append(clock() - t0)
    return min(times)


def make(query_lens, seq_lens, dtype):
    g = torch.Generator().manual_seed(0)
    max_blocks = max(-(-s // BLOCK) for s in seq_lens)
    num_blocks = len(seq_lens) * max_blocks
    caches = [torch.randn(num_blocks, BLOCK, HEADS, HEAD_SIZE, generator=g).to(DEVICE, dtype) for _ in range(2)]
    bt = torch.randperm(num_blocks, generator=g).view(len(seq_lens), max_blocks).int().to(DEVICE)
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    n = int(qsl[-1])
    q, k, v = (torch.randn(n, HEADS, HEAD_SIZE, generator=g).to(DEVICE, dtype) for _ in range(3))
    slots = torch.tensor([int(bt[r, p // BLOCK]) * BLOCK + p % BLOCK
                          for r, (ql, s) in enumerate(zip(query_lens, seq_lens)) for p in range(s - ql, s)],
                         device=DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    return dict(q=q, k=k, v=v, kc=caches[0], vc=caches[1], qsl=qsl, lens=lens, bt=bt, slots=slots,
                mq=max(query_lens), ms=max(seq_lens))


def bench_shape(name, query_lens, seq_lens, reps):
    dtype = torch.float16 if DEVICE == "cuda" else torch.float32
    b = make(query_lens, seq_lens, dtype)
    scale = HEAD_SIZE ** -0.5

    def attn():
        kernels.unified_attention(b["q"], b["kc"], b["vc"], b["qsl"], b["lens"], b["bt"], scale,
                                  max_query_len=b["mq"], max_seq_len=b["ms"])

    def attn_ref():
        kernels.unified_attention_ref(b["q"], b["kc"], b["vc"], b["qsl"], b["lens"], b["bt"], scale)

    def write():
        kernels.reshape_and_cache(b["k"], b["v"], b["kc"], b["vc"], b["slots"])

    def write_ref():
        kernels.reshape_and_cache_ref(b["k"], b["v"], b["kc"], b["vc"], b["slots"])

    rec = []
    with instrument.observe(rec.append):
        attn()
    row = dict(name=name, grid=rec[0].grid, attn=timeit(attn, reps), attn_ref=timeit(attn_ref, reps),
               write=timeit(write, reps), write_ref=timeit(write_ref, reps), bw="n/a", reason=rec[0].reason)
    if DEVICE == "cpu":
        # CPU time of the interpreted launches: what they cost without other processes around.
        row["bw"] = f"{fmt_ms(timeit(attn, reps, cpu_time=True))} / {fmt_ms(timeit(write, reps, cpu_time=True))}"
    if DEVICE == "cuda" and max(query_lens) == 1:
        # Decode reads every context key and value once; query and output are negligible.
        bytes_read = 2 * sum(seq_lens) * HEADS * HEAD_SIZE * b["kc"].element_size()
        gbps = bytes_read / row["attn"] / 1e9
        peak = next((p for k, p in PEAK_GBPS.items() if k in torch.cuda.get_device_name()), None)
        row["bw"] = f"{gbps:.0f} GB/s" + (f" ({gbps / peak:.0%} of {peak})" if peak else " (peak n/a)")
    return row


def bench_step(reps):
    """The engine's decode step of the built-in model: LAYERS x (cache write + attention)."""
    dtype = torch.float16 if DEVICE == "cuda" else torch.float32
    layers = [make([1] * 8, [64] * 8, dtype) for _ in range(LAYERS)]

    def step():
        for b in layers:
            kernels.reshape_and_cache(b["k"], b["v"], b["kc"], b["vc"], b["slots"])
            kernels.unified_attention(b["q"], b["kc"], b["vc"], b["qsl"], b["lens"], b["bt"], HEAD_SIZE ** -0.5,
                                      max_query_len=1, max_seq_len=64)

    def step_ref():
        for b in layers:
            kernels.reshape_and_cache_ref(b["k"], b["v"], b["kc"], b["vc"], b["slots"])
            kernels.unified_attention_ref(b["q"], b["kc"], b["vc"], b["qsl"], b["lens"], b["bt"], HEAD_SIZE ** -0.5)

    cpu = timeit(step, reps, cpu_time=True) if DEVICE == "cpu" else None
    return timeit(step, reps), cpu, timeit(step_ref, reps)


def bench_wrapper_overhead():
    """Cost instrument.launch adds over a direct launch when nobody observes (a no-op kernel)."""

    class NoOp:
        def __getitem__(self, grid):
            return lambda **kw: None

    k, n, grid, args, meta = NoOp(), 50_000, (1,), {"a": 1}, {"B": 2}

    def direct():
        for _ in range(n):
            k[grid](**args, **meta)

    def wrapped():
        for _ in range(n):
            instrument.launch("noop", k, grid, args, meta)

    return (timeit(wrapped, 7) - timeit(direct, 7)) / n


def fmt_ms(s):
    return f"{s * 1e3:.2f}" if s < 10 else f"{s:.1f} s"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=7 if DEVICE == "cpu" else 50)
    ap.add_argument("--no-write", action="store_true", help="do not update benchmarks/RESULTS.md")
    # One thread by default on the CPU: with small tensors on a shared 2-core machine, torch's
    # intra-op thread pool spends its time waking threads (the reference's decode step measured
    # ~24 ms with 2 threads under load vs ~0.3 ms with 1). The interpreter is single-threaded.
    ap.add_argument("--threads", type=int, default=1 if DEVICE == "cpu" else torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    device = device_name()
    rows = [bench_shape(*s, args.reps) for s in SHAPES]
    step, step_cpu, step_ref = bench_step(args.reps)
    overhead = bench_wrapper_overhead()

    lines = [
        f"Device: **{device}**; model shape: {HEADS} heads x {HEAD_SIZE}, block size {BLOCK}, "
        f"{'fp16' if DEVICE == 'cuda' else 'fp32'}. Times are the fastest of {args.reps} runs, in ms per launch; "
        f"{args.threads} torch thread(s).",
        "",
        "| batch | grid | attention (Triton) | attention (ref) | cache write (Triton) | cache write (ref) | "
        + ("decode bandwidth |" if DEVICE == "cuda" else "Triton attention / cache write, process CPU time |"),
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['name']} | {r['grid']} | {fmt_ms(r['attn'])} | {fmt_ms(r['attn_ref'])} | "
                     f"{fmt_ms(r['write'])} | {fmt_ms(r['write_ref'])} | {r['bw']} |")
    lines += [
        "",
        f"Simulated engine decode step (8 requests x 64-token contexts, {LAYERS} layers x (cache write + attention)): "
        f"**{fmt_ms(step)} ms** with the Triton kernels"
        + (f" ({fmt_ms(step_cpu)} ms of process CPU time)" if step_cpu is not None else "")
        + f", {fmt_ms(step_ref)} ms with the references.",
        "",
        f"`instrument.launch` overhead when nobody observes: {overhead * 1e9:.0f} ns per launch.",
        "",
        "Config chosen for the model's decode step: " + rows[0]["reason"],
    ]
    text = "\n".join(lines)
    print(text)
    print(f"\n(benchmark took {time.perf_counter() - t_start:.0f} s)")
    if not args.no_write:
        write_section(Path(__file__).with_name("RESULTS.md"), "Kernels", text)


def write_section(path: Path, title: str, body: str):
    """Replace (or append) the '## title' section, leaving other sections alone."""
    old = path.read_text() if path.exists() else "# Benchmark results\n"
    head = f"## {title}\n"
    section = f"{head}\n{body}\n"
    if head in old:
        start = old.index(head)
        end = old.find("\n## ", start + len(head))
        new = old[:start] + section + (old[end:] if end != -1 else "")
    else:
        new = old.rstrip("\n") + "\n\n" + section
    path.write_text(new)


if __name__ == "__main__":
    main()
