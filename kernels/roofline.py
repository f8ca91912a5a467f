"""The roofline: this machine's peak FLOP/s and memory bandwidth, and where an op sits under them.

An op that does ``flops`` arithmetic and moves ``bytes`` to and from memory has the arithmetic
intensity ``flops / bytes`` (FLOP per byte). It cannot run faster than ``peak_flops`` (the compute
roof) nor than ``intensity * peak_bw`` (the memory roof); the two meet at the ridge point
``peak_flops / peak_bw``. Below the ridge an op is memory-bound (more bandwidth would speed it
up), above it compute-bound.

Both peaks are measured, not taken from a data sheet: the best rate of a few square matmuls
(FLOP/s, ``2 n^3`` per product) and of a few copies of a buffer larger than the last-level cache
(bytes/s, read plus written). On the 2-core AMD EPYC this was written on, float32, shared with
other programs: 67-200 GFLOP/s (the best size varies from run to run, hence several sizes) and
17-27 GB/s, in 1.0-1.5 s; so calibration runs once per machine and is cached, keyed by a
fingerprint (CPU model or GPU name, torch version, threads, dtype): a copied cache directory or a
new torch is measured again, never trusted.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

MATMUL_SIZES = {"cpu": (256, 512, 1024), "cuda": (2048, 4096, 8192)}
COPY_BYTES = {"cpu": 128 << 20, "cuda": 1 << 30}  # past any CPU's L3 / any GPU's L2
REPEATS, BUDGET_S = 3, 0.2  # best of at least 3 runs a size, more within 0.2 s: a shared machine is noisy
CACHE_VERSION = 1


@dataclass(frozen=True)
class Roofline:
    """A machine's two roofs, as measured (``peak_flops`` FLOP/s, ``peak_bw`` bytes/s)."""

    peak_flops: float
    peak_bw: float
    device: str  # "cpu", "cuda"
    dtype: str  # the dtype the matmul ran in
    fingerprint: dict
    seconds: float  # how long the calibration took
    matmul_n: int  # the matmul size that reached peak_flops
    copy_bytes: int

    @property
    def ridge(self) -> float:
        """FLOP per byte at which the roofs meet: below it an op is memory-bound."""
        return self.peak_flops / self.peak_bw

    def attainable(self, intensity: float) -> float:
        """The roof over an intensity: min(peak FLOP/s, intensity × peak bandwidth)."""
        return min(self.peak_flops, intensity * self.peak_bw)

    def to_dict(self) -> dict:
        return {"version": CACHE_VERSION, **asdict(self)}

    @classmethod
    def from_dict(cls, d: dict) -> "Roofline":
        return cls(**{k: d[k] for k in ("peak_flops", "peak_bw", "device", "dtype", "fingerprint", "seconds",
                                         "matmul_n", "copy_bytes")})


def default_dtype(device: str) -> str:
    """float32 on a CPU; on a GPU the 16-bit type the engine computes in."""
    if device.startswith("cuda"):
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    return "float32"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def fingerprint(device: str = "cpu", dtype: str | None = None) -> dict:
    """What the peaks depend on: the processor, torch, the threads it may use, the dtype."""
    fp = {"device": device, "dtype": dtype or default_dtype(device), "cpu": cpu_model(),
          "cpus": os.cpu_count(), "threads": torch.get_num_threads(), "torch": torch.__version__}
    if device.startswith("cuda"):
        fp["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return fp


def fingerprint_key(fp: dict) -> str:
    return hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:16]


def _best(fn: Callable[[], None], sync: Callable[[], None]) -> float:
    """The shortest of REPEATS or more runs (more while BUDGET_S lasts), after one unmeasured
    run that pays for page faults and thread start-up."""
    fn()
    best, start = float("inf"), time.perf_counter()
    for i in range(1000):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t)
        if i + 1 >= REPEATS and time.perf_counter() - start > BUDGET_S:
            break
    return best


def measure(device: str = "cpu", dtype: str | None = None,
            progress: Callable[[str], None] | None = None) -> Roofline:
    """Calibrate: the best FLOP/s of square matmuls, the best bytes/s of a large copy."""
    dtype = dtype or default_dtype(device)
    fp = fingerprint(device, dtype)
    tdtype = getattr(torch, dtype)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    say = progress or (lambda _msg: None)
    start = time.perf_counter()
    peak_flops, best_n = 0.0, 0
    for n in MATMUL_SIZES["cuda" if device.startswith("cuda") else "cpu"]:
        a = torch.randn(n, n, device=device, dtype=tdtype)
        b = torch.randn(n, n, device=device, dtype=tdtype)
        out = torch.empty(n, n, device=device, dtype=tdtype)
        best = _best(lambda: torch.mm(a, b, out=out), sync)
        rate = 2 * n ** 3 / best
        say(f"matmul {n}×{n} {dtype}: {rate / 1e9:.1f} GFLOP/s")
        if rate > peak_flops:
            peak_flops, best_n = rate, n
    nbytes = COPY_BYTES["cuda" if device.startswith("cuda") else "cpu"]
    src = torch.ones(nbytes // 4, device=device, dtype=torch.float32)
    dst = torch.empty_like(src)
    best = _best(lambda: dst.copy_(src), sync)
    peak_bw = 2 * nbytes / best  # each byte read once and written once
    say(f"copy {nbytes >> 20} MiB: {peak_bw / 1e9:.1f} GB/s")
    return Roofline(peak_flops, peak_bw, device, dtype, fp, time.perf_counter() - start, best_n, nbytes)


def cache_path(cache_dir: str | os.PathLike, device: str = "cpu", dtype: str | None = None) -> Path:
    """Where this machine's calibration for (device, dtype) is kept."""
    fp = fingerprint(device, dtype)
    return Path(cache_dir) / "roofline" / f"{fp['device'].replace(':', '')}-{fp['dtype']}-{fingerprint_key(fp)}.json"


def cached(cache_dir: str | os.PathLike, device: str = "cpu", dtype: str | None = None) -> Roofline | None:
    """The calibration cached for this machine, or None (none yet, or made on another one)."""
    path = cache_path(cache_dir, device, dtype)
    try:
        d = json.loads(path.read_text())
        if d.get("version") != CACHE_VERSION or d.get("fingerprint") != fingerprint(device, dtype):
            return None
        return Roofline.from_dict(d)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def calibrate(cache_dir: str | os.PathLike, device: str = "cpu", dtype: str | None = None, recalibrate: bool = False,
              progress: Callable[[str], None] | None = None) -> tuple[Roofline, Path, bool]:
    """(roofline, its cache file, measured now): the cached one unless there is none or
    ``recalibrate``; a new measurement is written to the cache (atomically)."""
    path = cache_path(cache_dir, device, dtype)
    roof = None if recalibrate else cached(cache_dir, device, dtype)
    if roof is not None:
        return roof, path, False
    roof = measure(device, dtype, progress)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(roof.to_dict(), indent=1))
    os.replace(tmp, path)
    return roof, path, True


@dataclass(frozen=True)
class OpPoint:
    """One op (or a sum of ops) on the roofline: where it sits and which roof is over it."""

    flops: int
    bytes: int
    duration_ns: int

    @property
    def intensity(self) -> float:
        """FLOP per byte moved."""
        return self.flops / self.bytes if self.bytes else float("inf")

    @property
    def flops_per_s(self) -> float:
        return self.flops / self.duration_ns * 1e9 if self.duration_ns else 0.0

    @property
    def bytes_per_s(self) -> float:
        return self.bytes / self.duration_ns * 1e9 if self.duration_ns else 0.0

    def bound(self, roof: Roofline) -> str:
        """"memory" below the ridge point, "compute" at or above it."""
        return "memory" if self.intensity < roof.ridge else "compute"

    def efficiency(self, roof: Roofline) -> float:
        """Achieved FLOP/s as a share of the roof over this intensity."""
        attainable = roof.attainable(self.intensity)
        return self.flops_per_s / attainable if attainable else 0.0
