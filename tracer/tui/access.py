"""Which physical KV blocks each program of a kernel launch reads.

The map is computed here with the kernels' own mapping functions (the ones behind
``LaunchRecord.access_map``) from what the events carry: the launch's grid and
meta-parameters, and the step's flattened batch (query_start_loc, seq_lens, block_tables,
slot_mapping), which is the metadata the kernel was given. Live, replayed or attached, one
mapping and one input: the TUI never has its own idea of how programs split the work, and the
engine's kernel events stay plain data (a test checks the result equals the launch's own map).
"""
from __future__ import annotations

from tracer.state import TraceState


def access_map(kernel: dict, state: TraceState) -> dict | None:
    """pid -> tuple of kernels.instrument.ProgramAccess, or None when there is no grid."""
    if not kernel.get("grid") or state.batch is None:
        return None
    try:
        return _recompute(kernel, state.batch)
    except (KeyError, TypeError, ValueError, ImportError):  # an older trace without these fields
        return None


def _recompute(kernel: dict, batch: dict) -> dict:
    import torch

    from kernels.config import AttentionConfig, CacheConfig

    meta, grid, name = kernel.get("meta") or {}, kernel["grid"], kernel["name"]
    if name.startswith("unified_attention"):
        from kernels.unified_attention import _access_map
        hp = meta["HEADS_PER_PROG"]
        config = AttentionConfig(block_q=meta["BLOCK_Q"], q_blocks_per_program=meta["Q_BLOCKS"], tile_n=meta["TILE_N"],
                                 heads_per_program=hp, num_segments=meta.get("NUM_SEGMENTS", 1))
        qsl = torch.tensor(batch["query_start_loc"])
        out = _access_map(qsl, torch.tensor(batch["seq_lens"]), torch.tensor(batch["block_tables"]), config,
                          grid[1] * hp, meta["BLOCK_SIZE"], int(qsl[-1]))
    elif name == "reshape_and_cache":
        from kernels.reshape_and_cache import _access_map
        config = CacheConfig(tokens_per_program=meta["TOKENS"], block_hd=meta["BLOCK_HD"])
        out = _access_map(torch.tensor(batch["slot_mapping"]), config, meta["NUM_HEADS"], meta["HEAD_SIZE"],
                          meta["BLOCK_SIZE"])
    else:
        return {}
    m: dict = {}
    for a in out:
        m[a.pid] = m.get(a.pid, ()) + (a,)
    return m
