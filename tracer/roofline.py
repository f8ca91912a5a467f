"""A profiled step on the roofline: its ops sorted by time, summed per kind, against this machine's roofs.

While profiling is on (``/start_profile``, ``LLM.start_profile()``, `p` in the TUI) every op of the
forward pass is a kernel launch with ``profiled: true``, its ``op`` kind (matmul, norm, elementwise,
embedding, attention, cache_write, collective, sampler) and the ``flops`` and ``bytes`` it moves,
computed by the engine from the shapes. This module turns a step's launches into what the Kernels
panel, ``vllm-trace export --roofline`` and the lessons show; the roofs come from
``kernels.roofline``, calibrated once per machine into the project's cache directory.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from kernels.roofline import OpPoint, Roofline, cache_path, cached, calibrate

KINDS = ("matmul", "attention", "cache_write", "norm", "elementwise", "embedding", "sampler", "collective")


def cache_dir() -> Path:
    from engine.builtin_model import cache_root
    return cache_root()


def machine_roofline(device: str = "cpu", dtype: str | None = None, recalibrate: bool = False,
                     progress: Callable[[str], None] | None = None) -> tuple[Roofline, Path, bool]:
    """(roofline, cache file, measured now) for this machine: cached after the first call."""
    return calibrate(cache_dir(), _device(device), dtype, recalibrate, progress)


def cached_roofline(device: str = "cpu", dtype: str | None = None) -> Roofline | None:
    """This machine's calibration if it has been made (never measures: a UI thread may call it)."""
    try:
        return cached(cache_dir(), _device(device), dtype)
    except Exception:  # a CUDA trace read where there is no CUDA: no roofs to draw
        return None


def roofline_path(device: str = "cpu", dtype: str | None = None) -> Path:
    return cache_path(cache_dir(), _device(device), dtype)


def _device(device: str | None) -> str:
    return "cuda" if str(device or "cpu").startswith("cuda") else "cpu"


@dataclass(frozen=True)
class ProfiledOp:
    """One profiled launch as the table lists it."""

    name: str
    kind: str
    layer: int | None
    rank: int
    point: OpPoint

    @property
    def duration_ns(self) -> int:
        return self.point.duration_ns


def is_profiled(launch: dict) -> bool:
    return bool(launch.get("profiled"))


def profiled_ops(launches: list[dict]) -> list[ProfiledOp]:
    """The profiled launches, longest first."""
    ops = [ProfiledOp(k["name"], k.get("op") or "?", k.get("layer_idx"), k.get("rank") or 0,
                      OpPoint(int(k.get("flops") or 0), int(k.get("bytes") or 0), int(k.get("duration_ns") or 0)))
           for k in launches if is_profiled(k)]
    return sorted(ops, key=lambda o: -o.duration_ns)


def _summed(ops: list[ProfiledOp], key) -> dict[str, OpPoint]:
    """key(op) -> that group's launches summed (FLOPs, bytes, time)."""
    sums: dict[str, list[int]] = {}
    for o in ops:
        s = sums.setdefault(key(o), [0, 0, 0])
        s[0] += o.point.flops
        s[1] += o.point.bytes
        s[2] += o.point.duration_ns
    return {k: OpPoint(*v) for k, v in sums.items()}


def by_kind(ops: list[ProfiledOp]) -> dict[str, OpPoint]:
    """Each op kind's launches summed (FLOPs, bytes, time): one point per kind on the chart."""
    order = {k: i for i, k in enumerate(KINDS)}
    return dict(sorted(_summed(ops, lambda o: o.kind).items(), key=lambda kv: (order.get(kv[0], len(KINDS)), kv[0])))


def by_name(ops: list[ProfiledOp]) -> dict[str, OpPoint]:
    """Each op name's launches summed over the layers (``c_fc`` of every layer as one)."""
    return dict(sorted(_summed(ops, lambda o: o.name).items(), key=lambda kv: -kv[1].duration_ns))


def plotted(points: dict[str, OpPoint]) -> dict[str, OpPoint]:
    """The points a log-log chart can place: some arithmetic, some bytes, some time."""
    return {k: p for k, p in points.items() if p.flops > 0 and p.bytes > 0 and p.duration_ns > 0}


def trace_dtype(launches: list[dict]) -> str | None:
    """The dtype the step's matmuls ran in (the roof to compare with), from their arguments."""
    for k in launches:
        if k.get("op") == "matmul":
            for _shape, dtype in (k.get("args") or {}).values():
                if dtype:
                    return str(dtype).removeprefix("torch.")
    return None


def profiled_steps(events) -> dict[int, list[dict]]:
    """step -> its profiled launches (rank 0's), from a recorded trace's events."""
    from engine.trace_names import KERNEL
    steps: dict[int, list[dict]] = {}
    for ev in events:
        if ev.layer == KERNEL and ev.step is not None and ev.kind != "begin" and (ev.attrs or {}).get("profiled"):
            if (ev.attrs.get("rank") or 0) == 0:
                steps.setdefault(ev.step, []).append({"name": ev.name, **ev.attrs})
    return steps


def fmt_count(n: float, unit: str = "") -> str:
    """1234567 -> '1.23 M' (+unit): FLOPs, bytes, rates."""
    for div, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= div:
            return f"{n / div:.3g} {prefix}{unit}"
    return f"{n:.3g} {unit}".rstrip()


def chart_range(points: dict[str, OpPoint], roof: Roofline | None) -> tuple[float, float, float, float]:
    """(x_min, x_max, y_min, y_max), whole decades around the points and the ridge point: the axes
    of the log-log chart (FLOP/byte across, FLOP/s up)."""
    import math
    xs = [p.intensity for p in points.values()] + ([roof.ridge] if roof else [])
    ys = [p.flops_per_s for p in points.values()] + ([roof.peak_flops] if roof else [])
    xs, ys = [x for x in xs if 0 < x < float("inf")] or [1.0], [y for y in ys if y > 0] or [1e9]
    x0, x1 = math.floor(math.log10(min(xs))), math.ceil(math.log10(max(xs)) + 1e-9)
    y0, y1 = math.floor(math.log10(min(ys))), math.ceil(math.log10(max(ys)) + 1e-9)
    return 10.0 ** x0, 10.0 ** max(x1, x0 + 2), 10.0 ** y0, 10.0 ** max(y1, y0 + 2)


def roof_points(roof: Roofline, x_min: float, x_max: float, n: int = 64) -> list[tuple[float, float]]:
    """The roof (min of the two) sampled evenly in log space, the ridge point included."""
    import math
    lo, hi = math.log10(x_min), math.log10(x_max)
    xs = sorted({10 ** (lo + (hi - lo) * i / (n - 1)) for i in range(n)} | (
        {roof.ridge} if x_min < roof.ridge < x_max else set()))
    return [(x, roof.attainable(x)) for x in xs]
