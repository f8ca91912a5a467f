"""The Triton re-run (the Kernels panel's third mode): on the PyTorch backend, with the engine
held before an attention launch (`k`), `t` runs that very launch through our Triton kernel
(interpreted on a CPU); its grid and programs are drawn, with its difference from PyTorch's output."""
from __future__ import annotations

from rich.text import Text

from tracer.tui.widgets.kernels.launches import fmt_grid


def rerun_access(result: dict) -> dict:
    """kernels.rerun's programs (plain data) as the access map ProgramGrid draws."""
    from kernels.instrument import ProgramAccess  # (torch: only once a launch was re-run)

    m: dict = {}
    for p in result["programs"]:
        a = ProgramAccess(tuple(p["pid"]), p["request"], tuple(p["rows"]), tuple(p["kv_heads"]), tuple(p["blocks"]),
                          tuple(p["kv_positions"]) if p["kv_positions"] else None, p["segment"],
                          tuple(p["q_heads"]) if p.get("q_heads") else None)
        m[a.pid] = m.get(a.pid, ()) + (a,)
    return m


def rerun_text(held: dict, r: dict) -> Text:
    """What ran, where, on how many programs and rows, and the largest difference from PyTorch."""
    where = "the Triton interpreter (CPU)" if r["interpreted"] else "the GPU"
    return Text.assemble(
        ("t: ", "bold"), f"the held launch {held.get('name')} (layer {held.get('layer_idx')}) re-run as ",
        (r["name"], "bold"), f" on {where} in {r['seconds']:.2f} s\n",
        f"grid {fmt_grid(r['grid'])} = {r['num_programs']} program{'' if r['num_programs'] == 1 else 's'} for "
        f"{r['num_tokens']} query rows of {r['num_seqs']} request{'' if r['num_seqs'] == 1 else 's'} · ",
        ("max |Triton − PyTorch| = ", "bold"), (f"{r['max_abs_diff']:.2e}", "bold green"), (f"\n{r['reason']}", "dim"))
