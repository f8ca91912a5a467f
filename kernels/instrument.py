"""Launch instrumentation: every kernel launch goes through :func:`launch`.

Usage (thread-local, so engines in different threads never see each other's launches)::

    with instrument.observe(on_launch, before_launch=None, step=7):
        instrument.set_tags(layer=3)
        ...kernel calls...          # on_launch(LaunchRecord) after each launch

Observers nest: an inner ``observe`` sees the outer tags plus its own, every active observer
receives every record, and leaving a block restores the tags that were in force before it.
When nobody observes, :func:`launch` costs one thread-local attribute check.

Profiling: inside ``observe(..., profile=True)`` every :func:`op` (a PyTorch op of the forward
pass or of the sampler, not a kernel of ours) is a launch too, timed as tightly as Python
allows (the clock read just before and just after it; a launch made inside it, such as an
all-reduce inside a row-parallel matmul, is subtracted, being a launch of its own). Outside
such a block :func:`op` just runs the function.
"""
from __future__ import annotations

import functools
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from kernels._env import INTERPRETED


@dataclass(frozen=True)
class ProgramAccess:
    """What one program instance touches for one unit of its work, from host-side metadata."""

    pid: tuple[int, int, int]
    request: int | None  # None for kernels that are not per request (the cache write)
    rows: tuple[int, int]  # [start, end) rows of the flattened token dimension
    kv_heads: tuple[int, ...]
    blocks: tuple[int, ...]  # physical cache blocks, in the order the program walks them
    kv_positions: tuple[int, int] | None = None  # [start, end) key positions read (attention)
    segment: int | None = None  # KV segment (split-KV attention only)
    q_heads: tuple[int, ...] | None = None  # attention: the query heads reading these KV heads (h // group)


@dataclass
class LaunchRecord:
    """One kernel launch, as seen by observers.

    ``duration_ns`` is measured with CUDA events on the GPU (kernel time; the first launch of a
    new specialisation also includes Triton's JIT compile) and with the wall clock around the
    whole interpreted launch on the CPU; ``timing`` says which.
    """

    name: str
    grid: tuple[int, ...]
    meta: dict[str, Any]  # constexpr meta-parameters, num_warps, num_stages
    tags: dict[str, Any]  # shared by the launches made under the same tags: read, don't change
    duration_ns: int
    timing: str  # "cuda_event" or "wall_clock"
    reason: str  # why this config was chosen
    end_ns: int  # time.perf_counter_ns() when the launch returned (after the sync, on a GPU)
    # (argument, torch.Size, torch.dtype) of each tensor argument, as read at launch time
    raw_args: tuple[tuple[str, torch.Size, torch.dtype], ...] = field(default=(), repr=False)
    _access_fn: Callable[[], list[ProgramAccess]] | None = field(default=None, repr=False, compare=False)
    op: str | None = None  # a profiled op's kind ("matmul", "norm", ...; see kernels.op_cost); None for kernels

    @property
    def args(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """Tensor argument -> (shape, dtype name): converted on first access, not at launch,
        and shared by the launches whose arguments look the same (every layer of a step):
        read, don't change. (A plain property over that shared cache, not a cached_property,
        whose lock cost more than the lookup: ~2 us a record on Python 3.11.)"""
        args = _ARGS.get(self.raw_args)
        if args is None:
            if len(_ARGS) >= 1024:  # one entry per distinct batch shape: start again
                _ARGS.clear()
            args = _ARGS[self.raw_args] = {
                _ARG_NAMES.get(k) or _arg_name(k): (tuple(shape), _DTYPE_NAMES.get(dtype) or _dtype_name(dtype))
                for k, shape, dtype in self.raw_args}
        return args

    @functools.cached_property
    def access_map(self) -> dict[tuple[int, int, int], tuple[ProgramAccess, ...]]:
        """pid -> what the program touches, one entry per unit of work it handles.

        A GPU attention program handles one query block of one request; an interpreted one may
        stack several query blocks (of different requests). Programs with nothing to do are
        absent. Computed on first access, from a snapshot of the metadata taken at launch time;
        empty when every observer passed ``access_maps=False`` (no snapshot was taken).
        """
        out: dict[tuple[int, int, int], tuple[ProgramAccess, ...]] = {}
        for a in self._access_fn() if self._access_fn is not None else ():
            out[a.pid] = out.get(a.pid, ()) + (a,)
        return out


class _Frame:
    __slots__ = ("on_launch", "before_launch", "tags", "access", "profile", "gated")

    def __init__(self, on_launch, before_launch, tags: dict, access: bool, profile: bool, gated: bool):
        self.on_launch, self.before_launch, self.access, self.profile = on_launch, before_launch, access, profile
        self.gated = gated  # this frame or an outer one has a before_launch
        self.tags = tags  # replaced, never changed in place: a record shares the dict it was made with


class _State(threading.local):
    frames: tuple[_Frame, ...] = ()  # class default: a fresh thread starts unobserved
    pending: tuple[str, dict] | None = None  # (name, arguments) of the launch whose before_launch runs
    spent_ns: int = 0  # the durations of the launches recorded so far: what an op subtracts of those inside it


_state = _State()


class observe:
    """``with observe(on_launch, before_launch=None, *, access_maps=True, **tags):`` calls
    ``on_launch(record)`` after, and ``before_launch(name, grid, meta)`` before, each launch
    made by this thread inside the block; ``tags`` are copied into every record.
    ``access_maps=False``: this observer never reads ``record.access_map`` (the engine's tracer
    recomputes maps from the step's batch), so the launch need not snapshot its metadata for it.
    ``profile=True``: every :func:`op` inside the block is a launch too (inherited by inner blocks).
    (A class, not a generator context manager: the engine enters one every traced step.)"""

    __slots__ = ("_frame_args", "_outer")

    def __init__(self, on_launch: Callable[[LaunchRecord], None],
                 before_launch: Callable[[str, tuple, dict], None] | None = None, *,
                 access_maps: bool = True, profile: bool = False, **tags: Any):
        self._frame_args = (on_launch, before_launch, tags, access_maps, profile)

    def __enter__(self) -> None:
        outer = self._outer = _state.frames
        on_launch, before_launch, tags, access_maps, profile = self._frame_args
        inherited = outer[-1].tags if outer else {}
        profile = profile or bool(outer and outer[-1].profile)
        gated = before_launch is not None or bool(outer and outer[-1].gated)
        _state.frames = outer + (_Frame(on_launch, before_launch, {**inherited, **tags}, access_maps, profile,
                                        gated),)

    def __exit__(self, *exc) -> None:
        _state.frames = self._outer


def set_tags(**tags: Any) -> None:
    """Update the tags of the innermost ``observe`` block (no-op when nobody observes)."""
    if _state.frames:
        top = _state.frames[-1]
        top.tags = {**top.tags, **tags}


def current_tags() -> dict[str, Any]:
    return dict(_state.frames[-1].tags) if _state.frames else {}


def observed() -> bool:
    """Whether anyone observes this thread's launches (to compute what only a record needs)."""
    return bool(_state.frames)


def pending_launch() -> tuple[str, dict[str, Any]] | None:
    """Inside a ``before_launch`` callback: (name, arguments) of the launch about to be made by
    this thread (a viewer holding the engine there may re-run it on other inputs); else None."""
    return _state.pending


def _before(frames, name: str, grid: tuple, meta: dict, args: dict) -> None:
    _state.pending = (name, args)
    try:
        for f in frames:
            if f.before_launch is not None:
                f.before_launch(name, grid, meta)
    finally:
        _state.pending = None


def launch(
    name: str,
    kernel: Any,
    grid: tuple[int, ...],
    args: dict[str, Any],
    meta: dict[str, Any],
    *,
    reason: str = "",
    access: Callable[..., list[ProgramAccess]] | None = None,
    access_args: tuple = (),
    info: dict[str, Any] | None = None,
) -> None:
    """Launch ``kernel[grid](**args, **meta)``, recording it if anyone observes. ``info``: facts
    the record's ``meta`` carries besides the kernel's meta-parameters (not passed to the kernel).

    ``access(*access_args)`` computes the per-program access map; tensors in ``access_args`` are
    cloned at launch time (the engine reuses its metadata buffers) but the map itself is only
    computed if someone reads ``record.access_map``.
    """
    frames = _state.frames
    if not frames:
        kernel[grid](**args, **meta)
        return
    _observed_launch(frames, name, kernel, grid, args, meta, reason, access, access_args, info)


def _observed_launch(frames, name, kernel, grid, args, meta, reason, access, access_args, info=None):
    grid = tuple(int(g) for g in grid)
    if frames[-1].gated:  # someone may hold the engine before this launch
        _before(frames, name, grid, dict(meta), args)
    described, on_gpu = _describe(args)
    if on_gpu and not INTERPRETED:
        # Events measure the kernel, not the Python launch overhead; syncing is the price of
        # observing, and is only paid when someone observes.
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        kernel[grid](**args, **meta)
        end.record()
        end.synchronize()
        end_ns = time.perf_counter_ns()
        duration_ns, timing = int(start.elapsed_time(end) * 1e6), "cuda_event"
    else:
        t0 = time.perf_counter_ns()
        kernel[grid](**args, **meta)
        end_ns = time.perf_counter_ns()
        duration_ns, timing = end_ns - t0, "wall_clock"
    access_fn = None
    if access is not None and any(f.access for f in frames):
        snap = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in access_args)
        access_fn = functools.partial(access, *snap)
    meta = {**meta, **info} if info else dict(meta) if meta else {}
    _publish(frames, name, grid, meta, described, duration_ns, timing, reason, end_ns, access_fn)


def call(name: str, fn: Callable[..., Any], args: dict[str, Any], *, reason: str = "",
         meta: dict[str, Any] | None = None) -> Any:
    """Run a PyTorch function that stands in for a kernel (the reference backend, a collective),
    recorded like a launch when anyone observes: no grid (PyTorch picks its own), wall-clock
    time; meta: what the record's ``meta`` should say (a collective's bytes)."""
    frames = _state.frames
    if not frames:
        return fn(**args)
    meta = meta or {}
    if frames[-1].gated:
        _before(frames, name, (), meta, args)
    described, on_gpu = _describe(args)  # before the call, while its arguments are still in cache
    t0 = time.perf_counter_ns()
    out = fn(**args)
    if on_gpu:
        torch.cuda.synchronize()
    end_ns = time.perf_counter_ns()
    _publish(frames, name, (), meta, described, end_ns - t0, "wall_clock", reason, end_ns, None)
    return out


def op(name: str, kind: str, fn: Callable[..., Any], inputs: dict[str, Any], params: dict[str, Any] | None = None,
       meta: dict[str, Any] | None = None, reason: str = "") -> Any:
    """``fn(*inputs.values())``; while profiling (see the module docstring), recorded as a launch
    of op kind ``kind`` whose arguments are ``inputs``, ``params`` (tensors it reads that are not
    arguments: a layer's weight) and ``out`` (what it returned, if a tensor). ``meta`` is shared
    by every call with the same dict: read, don't change. For a function called many times a
    step, an :class:`Op` made once costs less per call."""
    frames = _state.frames
    if not frames or not frames[-1].profile:
        return fn(*inputs.values())
    return Op(name, kind, fn, tuple(inputs), params, meta, reason)(*inputs.values())


class Op:
    """``fn`` prepared once as a profiled op (a layer's forward): calling it calls ``fn``, and
    while profiling records it as :func:`op` does. Its parameters' description is taken here,
    once, and each call's bookkeeping is kept to what the record needs (measured by
    benchmarks/profiling.py: ~3 us a call, against ~4 us for the LayerNorm of a decode token
    itself; building the description from dicts at each call cost twice that)."""

    __slots__ = ("name", "kind", "fn", "arg_names", "described_params", "meta", "reason")

    def __init__(self, name: str, kind: str, fn: Callable[..., Any], arg_names: tuple[str, ...],
                 params: dict[str, Any] | None = None, meta: dict[str, Any] | None = None, reason: str = ""):
        self.name, self.kind, self.fn, self.arg_names = name, kind, fn, arg_names
        self.described_params = _describe(params)[0] if params else ()
        self.meta, self.reason = meta if meta is not None else {}, reason

    def __call__(self, *args: Any) -> Any:
        frames = _state.frames
        if not frames or not frames[-1].profile:
            return self.fn(*args)
        if frames[-1].gated:
            _before(frames, self.name, (), self.meta, dict(zip(self.arg_names, args)))
        described, Tensor, first = [], torch.Tensor, None
        for k, v in zip(self.arg_names, args):
            if isinstance(v, Tensor):
                described.append((k, v.shape, v.dtype))
                first = v if first is None else first
        on_gpu = first is not None and first.is_cuda
        state = _state
        if on_gpu:
            torch.cuda.synchronize()  # what was queued before belongs to earlier ops
        spent = state.spent_ns
        t0 = time.perf_counter_ns()
        out = self.fn(*args)
        if on_gpu:
            torch.cuda.synchronize()
        end_ns = time.perf_counter_ns()
        inner = state.spent_ns - spent  # launches made inside this op (an all-reduce) are launches of their own
        if isinstance(out, Tensor):
            described.append(("out", out.shape, out.dtype))
        _publish(frames, self.name, (), self.meta, (*described, *self.described_params), end_ns - t0 - inner,
                 "wall_clock", self.reason, end_ns, None, self.kind)
        return out


def _describe(args: dict[str, Any]) -> tuple[tuple[tuple[str, torch.Size, torch.dtype], ...], bool]:
    """((argument, shape, dtype) of each tensor argument, whether they are on a GPU), read
    as cheaply as torch allows: this runs at every observed launch, on the engine's thread,
    between kernels, where every object touched is a cache miss (measured: ~9 us a launch
    when each description was converted to plain data here). A kernel's tensors share one
    device, so the first one says which."""
    raw, first, Tensor = [], None, torch.Tensor
    for k, v in args.items():
        if isinstance(v, Tensor):
            raw.append((k, v.shape, v.dtype))
            if first is None:
                first = v
    return tuple(raw), first is not None and first.is_cuda


_DTYPE_NAMES: dict[torch.dtype, str] = {}
_ARGS: dict[tuple, dict[str, tuple[tuple[int, ...], str]]] = {}  # raw_args -> LaunchRecord.args


def _dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


_ARG_NAMES: dict[str, str] = {}  # a Triton kernel's `q_ptr` is its argument `q`


def _arg_name(k: str) -> str:
    name = _ARG_NAMES[k] = k.removesuffix("_ptr")
    return name


def _publish(frames, name, grid, meta, described, duration_ns, timing, reason, end_ns, access_fn, kind=None) -> None:
    record = LaunchRecord(name, grid, meta, frames[-1].tags, duration_ns, timing, reason, end_ns, described, access_fn,
                          kind)
    _state.spent_ns += duration_ns
    for f in frames:
        f.on_launch(record)
