"""The launch list: this step's launches, one row each (the Kernels panel's first mode).

A Triton launch shows its grid and meta-parameters; a PyTorch reference has no grid and shows
its argument shapes. With tensor parallelism every rank's launches arrive, the collectives
(all_reduce, all_gather) among them: a rank column appears, `r` cycles the list through rank
0, 1, ... and all, and a line per rank sums its launches and its share of time communicating.
"""
from __future__ import annotations

from rich.text import Text

from engine.trace_names import ALL_GATHER, ALL_REDUCE, is_attention_kernel
from tracer.state import TraceState, rank_of, step_ranks
from tracer.tui.fmt import fmt_bytes, fmt_ns, sparkline
from tracer.tui.frame import Frame
from tracer.tui.widgets.rows import cells_text

META_SHOWN = ("BLOCK_Q", "Q_BLOCKS", "TILE_N", "HEADS_PER_PROG", "NUM_SEGMENTS", "TOKENS", "BLOCK_HD", "num_warps")
COLLECTIVES = (ALL_REDUCE, ALL_GATHER)
# What the list holds, said on the panel: a learner otherwise takes it for the whole forward pass.
SCOPE = ("listed: each layer's KV-cache write and paged attention, and any collectives",
         "not listed: matmuls, layer norms, MLP, LM head, sampler (p profiles them too)")


def short_meta(meta: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in meta.items() if k in META_SHOWN) or "-"


def fmt_grid(grid) -> str:
    """A launch grid as x×y×z (the same in the table and over the picture)."""
    grid = tuple(grid or ())
    return "×".join(map(str, grid + (1,) * (3 - len(grid)))) if grid else "-"


def arg_shapes(args: dict | None) -> str:
    """'query 11×4×32 key_cache 64×4×4×32 …' (what a PyTorch reference call was given)."""
    if not args:
        return "-"
    return " ".join(f"{name} {'×'.join(map(str, shape)) or 'scalar'}" for name, (shape, _dtype) in args.items())


def collective_detail(launch: dict) -> str:
    """'2.0 KiB attn.c_proj (sum over 2 ranks)': what an all_reduce / all_gather row shows."""
    m = launch.get("meta") or {}
    over = f"{m.get('op', '?')} over {m.get('world_size', '?')} ranks"
    return f"{fmt_bytes(m.get('bytes'))} {m.get('site', '?')} ({over})"


def rank_summary(kernels: list[dict], rank: int) -> str:
    """'rank 0: 17 launches · 9.1 ms · communication 6.2 ms (68%)'."""
    mine = [k for k in kernels if rank_of(k) == rank]
    total = sum(k.get("duration_ns") or 0 for k in mine)
    comm = sum(k.get("duration_ns") or 0 for k in mine if k["name"] in COLLECTIVES)
    share = f" ({comm / total:.0%})" if total else ""
    return (f"rank {rank}: {len(mine)} launch{'' if len(mine) == 1 else 'es'} · {fmt_ns(total)} · "
            f"communication {fmt_ns(comm)}{share}")


def multi_rank(s: TraceState) -> bool:
    return s.tensor_parallel_size > 1 or len(step_ranks(s)) > 1


def held_launch(frame: Frame) -> dict | None:
    """The launch the engine is held before ({name, grid, layer_idx, step}), if it is."""
    c = frame.controller
    if c.get("paused") and c.get("point") == "kernel":
        return (frame.state.paused_at or {}).get("info") or {}
    return None


def launch_head(frame: Frame, launches: list[dict], rank: int | None) -> Text:
    """'step 3: 8 launches (execute)', where the engine is held, the ranks, and what is listed."""
    s = frame.state
    head = Text.assemble((f"step {'-' if s.step is None else s.step}: ", "bold"),
                         (f"{len(launches)} launch{'' if len(launches) == 1 else 'es'}", "bold"),
                         (f" ({s.phase})" if s.phase not in ("done", "idle") else "", "dim"))
    held = held_launch(frame)
    if held is not None:
        layer = held.get("layer_idx", "?")  # None: a launch of no layer (building the inputs, sampling)
        head.append(f"   held before {held.get('name', '?')}{'' if layer is None else f' (layer {layer})'}", "yellow")
        if is_attention_kernel(held.get("name")) and held.get("name") != "unified_attention":
            head.append("  t: run it on Triton", "bold yellow")
    if multi_rank(s):
        head.append(f"   rank {'all' if rank is None else rank} of {s.tensor_parallel_size}", "bold")
        head.append("  (r: next rank)", "dim")
        for r in step_ranks(s):
            head.append("\n" + rank_summary(s.kernels, r), "bold" if r == rank else "")
    head.append("\n" + "\n".join(SCOPE), "dim")
    return head


def launch_table(s: TraceState, launches: list[dict], width: int) -> tuple[tuple, list[tuple[str, tuple]]]:
    """(header, rows) of the launch list, the last column (meta / shapes) taking the rest of `width`."""
    ranks = multi_rank(s)
    names = [k["name"] for k in launches]
    grids = [fmt_grid(k.get("grid")) for k in launches]
    columns = [("#", 3), *([("rank", 4)] if ranks else []), ("layer", 5), ("kernel", max([6] + list(map(len, names)))),
               ("grid", max([4] + list(map(len, grids)))), ("time", 9), ("per step", 12), ("meta / argument shapes", 0)]
    widths = [w for _, w in columns]
    widths[-1] = max(10, width - sum(widths[:-1]) - 2 * len(widths) - 2)
    rows = []
    for i, k in enumerate(launches):
        if k["name"] in COLLECTIVES:
            detail = collective_detail(k)
        else:
            detail = short_meta(k["meta"]) if k.get("meta") else arg_shapes(k.get("args"))
        rank = [str(rank_of(k))] if ranks else []
        layer = "" if k.get("layer_idx") is None else str(k["layer_idx"])  # a gather, a draft model's launch
        rows.append((str(i), cells_text([str(i), *rank, layer, k["name"], grids[i], fmt_ns(k.get("duration_ns")),
                                         sparkline(s.kernel_history.get(k["name"], []), 12), detail], widths)))
    return cells_text([n for n, _ in columns], widths), rows
