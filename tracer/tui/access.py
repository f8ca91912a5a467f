"""Which physical KV blocks each program of a kernel launch reads.

The map is computed by ``kernels.access_map`` (the same mapping behind
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
    # imported here: the kernels package loads triton, which a replay that shows no launch never needs
    from kernels import access_map as kernel_access_map

    return kernel_access_map(kernel["name"], kernel.get("meta") or {}, kernel["grid"], batch)
