"""CPU kernels in C, vLLM's ``csrc/cpu`` twin: paged attention for decodes and Gumbel-max's candidates.

On the CPU our Triton kernels can only run through Triton's interpreter, far slower than PyTorch, and the
PyTorch references stand in for them. Two of those pay for being built from whole-tensor ops:

* attention gathers every request's K/V blocks into a padded copy, then runs SDPA over the copy: three
  passes over a few megabytes a layer. ``attention.c`` reads each key and value row once, in place.
  Measured at 32 decodes of 64-128 tokens (tiny-gpt2's 4 heads of 32): 91 us a layer against 233 us.
  It takes the rows of decodes and short queries only; longer prefill chunks stay with SDPA, whose
  blocked matrix products beat a row at a time there (8 prompts of 64 tokens: 320 us against 484 us).
* a Gumbel-max draw hashes every token of the vocabulary and finds the few that can win; the numpy
  reference spends 344 us on 32 rows of 4,096 tokens doing that with fourteen whole-array passes.
  ``gumbel.c`` hashes and filters each row in one pass; the candidates are scored exactly by the same
  numpy code as the reference's, so both draw the same token.

They are compiled on first use with the system's C compiler (``$CC``, else ``cc``; a fraction of a
second) for the instruction set of the machine they run on, and cached in ``$VLLM_TRACE_CACHE_DIR`` (default
``~/.cache/vllm-trace``). :func:`available` says whether that worked; without a compiler the engine uses
the PyTorch references (``attention_backend='torch'``), with the same results.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import torch

from kernels import reference

SOURCES = ("attention.c", "gumbel.c")
# Requests each OpenMP thread takes at least (up to the engine's torch threads: one when serving, every core
# offline): waking a thread costs microseconds, a decode's attention a few.
MIN_REQUESTS_PER_THREAD = 8
# No -ffast-math: the kernels compare with -inf (masked logits, an empty running max). Reassociation
# alone lets the compiler vectorise the dot products and sums.
CFLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-fno-math-errno", "-fno-trapping-math", "-fno-signed-zeros",
          "-fassociative-math")
# Tried in order, the first that builds kept. -fopenmp: the library needs libgomp.so.1, which the loader finds
# already loaded, torch's own, so the attention's threads are torch's (no second pool of threads spinning
# against them); without it (a compiler with no OpenMP) one thread. -DVECTOR_EXPF -lmvec: glibc's vector expf.
VARIANTS = (("-fopenmp", "-DVECTOR_EXPF", "-lmvec"), ("-fopenmp",), ())


class Shape(ctypes.Structure):
    _fields_ = [("num_q_heads", ctypes.c_int), ("num_kv_heads", ctypes.c_int), ("head_size", ctypes.c_int),
                ("block_size", ctypes.c_int), ("q_token_stride", ctypes.c_int64),
                ("q_head_stride", ctypes.c_int64), ("table_stride", ctypes.c_int64)]


_P, _I, _I64, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {
    "cpu_attention_with_kv_cache": (_I, [_P, _P, _P, _P, _P, _P, _P, _P, _I, Shape, _F, _I, _P, _I]),
    "gumbel_candidates": (_I64, [_P, _I, _I, _P, _P, ctypes.c_uint32, _F, _P, _P, _I64]),
}


def cache_dir() -> Path:
    return Path(os.environ.get("VLLM_TRACE_CACHE_DIR") or Path.home() / ".cache" / "vllm-trace")


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc"))


def _library_path(cc: str) -> Path:
    """The cached library's path: named for what went into it (sources, flags, compiler, machine)."""
    key = hashlib.sha256()
    for name in SOURCES:
        key.update((Path(__file__).parent / name).read_bytes())
    key.update(" ".join((cc, *CFLAGS, *map(repr, VARIANTS), platform.machine(), _cpu_flags())).encode())
    return cache_dir() / f"cpu_kernels-{key.hexdigest()[:16]}.so"


def _cpu_flags() -> str:
    """This CPU's feature flags (-march=native compiles for them): a library built elsewhere is not reused."""
    try:
        return next((line for line in open("/proc/cpuinfo") if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


def _build(cc: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # built aside, then moved in whole:
        built = Path(tmp) / target.name  # processes starting together never load a half-written file
        sources = [str(Path(__file__).parent / name) for name in SOURCES]
        for variant in VARIANTS:
            done = subprocess.run([cc, *CFLAGS, *sources, "-o", str(built), *variant, "-lm"], capture_output=True,
                                  text=True)
            if done.returncode == 0:
                break
        done.check_returncode()
        os.replace(built, target)


@functools.cache
def load() -> ctypes.CDLL | str:
    """The compiled kernels, built on first use; or, if they can't be, why not (one line)."""
    cc = _compiler()
    if cc is None:
        return f"no C compiler ({os.environ.get('CC', 'cc')}) on PATH"
    target = _library_path(cc)
    try:
        if not target.exists():
            try:
                _build(cc, target)
            except PermissionError:  # a read-only home: this user's temporary directory instead
                target = Path(tempfile.gettempdir()) / f"vllm-trace-{os.getuid()}" / target.name
                if not target.exists():
                    _build(cc, target)
        lib = ctypes.CDLL(str(target))
    except subprocess.CalledProcessError as e:
        return f"{cc} failed: {(e.stderr or '').strip().splitlines()[-1:] or e}"
    except OSError as e:
        return f"could not build or load {target}: {e}"
    for name, (restype, argtypes) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


def available() -> bool:
    return not isinstance(load(), str)


def require() -> None:
    """Raise RuntimeError, saying why and what to do, unless the kernels are available."""
    _lib()


def _lib() -> ctypes.CDLL:
    lib = load()
    if isinstance(lib, str):
        raise RuntimeError(f"attention_backend='cpu' needs the C kernels of kernels/cpu, which are unavailable "
                           f"here: {lib}. Install a C compiler (or set CC), or use attention_backend='torch'")
    return lib


def cpu_attention_with_kv_cache(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                                query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                                scale: float, reqs: np.ndarray, out: torch.Tensor, sliding_window: int | None = None,
                                sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of requests ``reqs``'s query rows over their paged context, written into
    ``out`` [num_tokens, num_q_heads, head_size] (contiguous); as :func:`kernels.unified_attention_ref`
    computes it. Metadata as the engine builds it: int32, contiguous."""
    qsl, lens, tables = (t if t.dtype == torch.int32 and t.is_contiguous() else t.to(torch.int32).contiguous()
                         for t in (query_start_loc, seq_lens, block_tables))
    reqs = np.ascontiguousarray(reqs, np.int32)
    shape = Shape(query.shape[1], key_cache.shape[2], query.shape[2], key_cache.shape[1], query.stride(0),
                  query.stride(1), tables.stride(0))
    sink = sinks.float().contiguous() if sinks is not None else None
    threads = max(1, min(torch.get_num_threads(), len(reqs) // MIN_REQUESTS_PER_THREAD))
    rc = _lib().cpu_attention_with_kv_cache(
        out.data_ptr(), query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), qsl.data_ptr(),
        lens.data_ptr(), tables.data_ptr(), reqs.ctypes.data, len(reqs), shape, scale, sliding_window or 0,
        sink.data_ptr() if sink is not None else None, threads)
    if rc:
        raise MemoryError("cpu_attention_with_kv_cache: out of memory for its score buffer")
    return out


def gumbel_sample(logits: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                  stream: int = 0) -> torch.Tensor:
    """:func:`kernels.gumbel_sample_ref`'s draw (the same token), its candidates found in C."""
    rows, vocab = logits.shape
    if rows == 0:
        return torch.empty(0, dtype=torch.int64, device=logits.device)
    seeds = seeds.to(torch.int64).cpu().numpy().reshape(rows, 1)
    pos = positions.to(torch.int64).cpu().numpy().reshape(rows, 1)
    with np.errstate(over="ignore"):
        row_hash = np.ascontiguousarray(reference._murmur3_rows(seeds, pos, stream).ravel())
    scores = np.ascontiguousarray(logits.detach().float().cpu().numpy())
    keys = reference._token_keys(vocab)
    capacity = 64 * rows
    while True:
        flat, hashes = np.empty(capacity, np.int64), np.empty(capacity, np.uint32)
        n = _lib().gumbel_candidates(scores.ctypes.data, rows, vocab, row_hash.ctypes.data, keys.ctypes.data,
                                     int(reference._LIKELY), float(reference._LIKELY_NOISE), flat.ctypes.data,
                                     hashes.ctypes.data, capacity)
        if n >= 0:
            break
        if capacity >= rows * vocab:
            raise MemoryError("gumbel_candidates: out of memory for its hash buffer")
        capacity = min(rows * vocab, capacity * 16)  # flat rows (every token allowed, none likely)
    best = reference._gumbel_winners(scores, flat[:n], hashes[:n])
    return torch.from_numpy(best).to(logits.device)
