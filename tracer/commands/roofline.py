"""`vllm-trace roofline [--calibrate]`: this machine's peak FLOP/s and memory bandwidth, the two roofs
the profiled Kernels panel and `export --roofline` place each op under."""
from __future__ import annotations

import argparse
import sys

from tracer.commands import HelpFormatter
from tracer.errors import UserError


def register(sub) -> None:
    p = sub.add_parser("roofline", help="this machine's peak FLOP/s and memory bandwidth (measured once, cached)",
                       description="Print the roofline this machine's profiled steps are drawn against: the peak "
                                   "FLOP/s of a matmul and the bandwidth of a large copy, measured once (about a "
                                   "second) and cached per machine (CPU model or GPU name, torch version, "
                                   "threads, dtype). --calibrate measures again.",
                       formatter_class=HelpFormatter)
    p.add_argument("--calibrate", action="store_true", help="measure again and replace the cached figures")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="the device to measure")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="the matmul's dtype (default: float32 on a CPU, the engine's 16-bit type on a GPU)")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from tracer.roofline import cached_roofline, fmt_count, machine_roofline

    if args.device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: torch sees no CUDA device here; measure the CPU (--device cpu)")
    if args.calibrate or cached_roofline(args.device, args.dtype) is None:
        print(f"calibrating the roofline on {args.device} (a matmul, then a copy)…", file=sys.stderr)
    roof, path, measured = machine_roofline(args.device, args.dtype, recalibrate=args.calibrate,
                                            progress=lambda msg: print(f"  {msg}", file=sys.stderr))
    fp = roof.fingerprint
    where = fp.get("gpu") or fp.get("cpu")
    print(f"device      {roof.device} ({where}; torch {fp['torch']}, {fp['threads']} threads)")
    print(f"peak        {fmt_count(roof.peak_flops, 'FLOP/s')}  (matmul {roof.matmul_n}×{roof.matmul_n} {roof.dtype})")
    print(f"bandwidth   {fmt_count(roof.peak_bw, 'B/s')}  (copy of {roof.copy_bytes >> 20} MiB: read + written)")
    print(f"ridge       {roof.ridge:.1f} FLOP/byte  (below it an op is memory-bound, above it compute-bound)")
    how = f"measured now in {roof.seconds:.1f} s" if measured else "cached; --calibrate measures again"
    print(f"cache       {path}  ({how})")
    return 0
