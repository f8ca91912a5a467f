"""Which physical KV blocks each program of a launch touches, from what a trace records of it.

A launch's ``LaunchRecord.access_map`` needs the live tensors; a viewer (the TUI, live, replayed
or attached) has only plain data: the kernel's name, its meta-parameters and grid, and the
step's flattened batch. ``access_map`` rebuilds the kernel's config from its own meta-parameter
names and runs the same host-side mapping the launch uses, so the tracer never learns how a
kernel splits its work (tests check both maps are equal, program for program).
"""
from __future__ import annotations

import torch

from kernels.config import AttentionConfig, CacheConfig
from kernels.instrument import ProgramAccess
from kernels.reshape_and_cache import _access_map as _cache_write_map
from kernels.unified_attention import _access_map as _attention_map

AccessMap = dict[tuple[int, ...], tuple[ProgramAccess, ...]]


def access_map(name: str, meta: dict, grid: list[int] | tuple[int, ...], batch: dict) -> AccessMap:
    """pid -> the accesses of that program, for a launch of kernel ``name`` (empty for a kernel
    that reads no KV blocks). ``batch`` holds the step's query_start_loc, seq_lens, block_tables
    and slot_mapping as lists. Raises KeyError when a field the kernel needs is missing."""
    if name.startswith("unified_attention"):
        hp = meta["HEADS_PER_PROG"]
        config = AttentionConfig(block_q=meta["BLOCK_Q"], q_blocks_per_program=meta["Q_BLOCKS"],
                                 tile_n=meta["TILE_N"], heads_per_program=hp,
                                 num_segments=meta.get("NUM_SEGMENTS", 1))
        qsl = torch.tensor(batch["query_start_loc"])
        out = _attention_map(qsl, torch.tensor(batch["seq_lens"]), torch.tensor(batch["block_tables"]), config,
                             grid[1] * hp, meta["BLOCK_SIZE"], int(qsl[-1]), meta.get("GROUP", 1))
    elif name == "reshape_and_cache":
        config = CacheConfig(tokens_per_program=meta["TOKENS"], block_hd=meta["BLOCK_HD"])
        out = _cache_write_map(torch.tensor(batch["slot_mapping"]), config, meta["NUM_HEADS"], meta["HEAD_SIZE"],
                               meta["BLOCK_SIZE"])
    else:
        return {}
    m: AccessMap = {}
    for a in out:
        m[a.pid] = m.get(a.pid, ()) + (a,)
    return m
