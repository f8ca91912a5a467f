"""Run one attention (or fused-MoE) call's inputs through our Triton kernel and say what its launch did.

The CPU default backend is the PyTorch reference, whose launches have no program grid. A
viewer held before such an attention call can hand its inputs here: the Triton kernel runs on
them (through the interpreter when there is no GPU), and the answer is plain data, so it can
travel between processes: the grid, each program's work (the query rows, KV heads and
physical blocks it reads), and the largest |Triton - PyTorch| difference over the output.
This module knows nothing of the engine; the engine hands it tensors.
"""
from __future__ import annotations

import math
import time

import torch

from kernels import instrument
from kernels.fused_moe import fused_moe
from kernels.reference import fused_moe_ref, unified_attention_ref
from kernels.unified_attention import unified_attention

ATTENTION_INPUTS = ("query", "key_cache", "value_cache", "query_start_loc", "seq_lens", "block_tables", "scale")
ATTENTION_OPTIONS = ("sliding_window", "sinks")  # passed when the call had them
MOE_INPUTS = ("hidden_states", "w13", "w2", "topk_weights", "topk_ids", "expert_map")
MOE_OPTIONS = ("w13_bias", "w2_bias", "activation", "swiglu_alpha", "swiglu_limit")


def attention_inputs(args: dict) -> dict:
    """The inputs of an attention call, cloned: the engine that made them may move on while
    the kernel runs on the copies. Takes the reference's arguments or the Triton kernel's
    (``query_ptr``, ...)."""
    args = {k.removesuffix("_ptr"): v for k, v in args.items()}
    missing = [k for k in ATTENTION_INPUTS if k not in args]
    if missing:
        raise ValueError(f"not an attention call: no {', '.join(missing)}")
    return _cloned(args, ATTENTION_INPUTS, ATTENTION_OPTIONS)


def _cloned(args: dict, names: tuple[str, ...], options: tuple[str, ...]) -> dict:
    keys = [*names, *(k for k in options if args.get(k) is not None)]
    return {k: args[k].clone() if isinstance(args[k], torch.Tensor) else args[k] for k in keys}


def attention_on_triton(query, key_cache, value_cache, query_start_loc, seq_lens, block_tables, scale,
                        **options) -> dict:
    """Run unified_attention (Triton) and unified_attention_ref (PyTorch) on the same inputs
    (``options``: the call's sliding_window and sinks, when it had them).

    Returns {"name", "grid", "meta", "reason", "seconds", "interpreted", "num_programs",
    "programs": [{"pid", "request", "rows", "kv_heads", "blocks", "kv_positions", "segment", "q_heads"}],
    "max_abs_diff", "num_tokens", "num_seqs"}: lists and numbers only."""
    records: list[instrument.LaunchRecord] = []
    t0 = time.perf_counter()
    with torch.inference_mode(), instrument.observe(records.append):
        out = unified_attention(query, key_cache, value_cache, query_start_loc, seq_lens, block_tables, scale,
                                **options)
    seconds = time.perf_counter() - t0
    with torch.inference_mode():
        ref = unified_attention_ref(query, key_cache, value_cache, query_start_loc, seq_lens, block_tables, scale,
                                    **options)
    launch = next(r for r in records if r.name.startswith("unified_attention"))
    programs = [dict(pid=list(a.pid), request=a.request, rows=list(a.rows), kv_heads=list(a.kv_heads),
                     blocks=list(a.blocks), kv_positions=list(a.kv_positions) if a.kv_positions else None,
                     segment=a.segment, q_heads=list(a.q_heads))
                for pid in sorted(launch.access_map) for a in launch.access_map[pid]]
    diff = (out.float() - ref.float()).abs()
    return dict(name=launch.name, grid=list(launch.grid), meta=dict(launch.meta), reason=launch.reason,
                seconds=seconds, interpreted=instrument.INTERPRETED, num_programs=math.prod(launch.grid),
                programs=programs, max_abs_diff=float(diff.max()) if diff.numel() else 0.0,
                num_tokens=int(query.shape[0]), num_seqs=int(seq_lens.shape[0]))


def moe_inputs(args: dict) -> dict:
    """The inputs of a fused-MoE reference call (``fused_moe_ref``'s arguments), cloned."""
    missing = [k for k in MOE_INPUTS if k not in args]
    if missing:
        raise ValueError(f"not a fused-MoE call: no {', '.join(missing)}")
    return _cloned(args, MOE_INPUTS, MOE_OPTIONS)


def moe_on_triton(hidden_states, w13, w2, topk_weights, topk_ids, expert_map=None, **options) -> dict:
    """Run fused_moe (Triton: its two grouped GEMMs) and fused_moe_ref on the same inputs (``options``:
    the experts' biases and activation, when the call had them); the same plain data as
    attention_on_triton, of the first GEMM (w13), each program's ``blocks`` being its expert, and
    ``launches``: both GEMMs' name, grid and meta."""
    records: list[instrument.LaunchRecord] = []
    t0 = time.perf_counter()
    with torch.inference_mode(), instrument.observe(records.append):
        out = fused_moe(hidden_states, w13, w2, topk_weights, topk_ids, expert_map, **options)
    seconds = time.perf_counter() - t0
    with torch.inference_mode():
        ref = fused_moe_ref(hidden_states, w13, w2, topk_weights, topk_ids, expert_map, **options)
    first = records[0]
    programs = [dict(pid=list(a.pid), request=None, rows=list(a.rows), kv_heads=[], blocks=list(a.blocks),
                     kv_positions=None, segment=None, q_heads=[])
                for pid in sorted(first.access_map) for a in first.access_map[pid]]
    diff = (out.float() - ref.float()).abs()
    return dict(name=first.name, grid=list(first.grid), meta=dict(first.meta), reason=first.reason, seconds=seconds,
                interpreted=instrument.INTERPRETED, num_programs=math.prod(first.grid), programs=programs,
                max_abs_diff=float(diff.max()) if diff.numel() else 0.0, num_tokens=int(hidden_states.shape[0]),
                num_seqs=None, launches=[dict(name=r.name, grid=list(r.grid), meta=dict(r.meta)) for r in records])
