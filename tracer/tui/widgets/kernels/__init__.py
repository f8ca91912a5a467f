"""Kernels: the launches of this step, and for an attention launch, its programs.

The panel (``panel.KernelsPanel``) shows one of four modes, each in its own module:

* ``launches``: this step's launches (grid and meta-parameters for Triton, argument shapes for
  the PyTorch references; the collectives with tensor parallelism, with a line per rank).
* ``programs``: under the list, the program grid of the chosen Triton launch, one row per KV
  head, and the physical KV blocks the chosen program reads through the block table.
* ``rerun``: on the PyTorch backend, with the engine held before an attention launch (`k`), `t`
  runs that very launch through our Triton kernel (interpreted on a CPU): its grid, its
  programs and its difference from the PyTorch output.
* ``profiled``: while profiling (`p`, or POST /start_profile) every op of the forward pass is a
  launch: the step's ops longest first, with their share of the step, arithmetic intensity,
  achieved rate and bound against this machine's roofline, over a roofline chart.

The modules that need torch (the roofline, the re-run's access map) import it when a mode needs
it, so the TUI draws before torch is loaded.
"""
from tracer.tui.widgets.kernels.launches import held_launch
from tracer.tui.widgets.kernels.panel import KernelsPanel
from tracer.tui.widgets.kernels.programs import ProgramGrid

__all__ = ["KernelsPanel", "ProgramGrid", "held_launch"]
