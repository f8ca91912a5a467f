"""Decide, before any kernel is decorated, whether Triton runs natively or interpreted.

``triton.jit`` picks the interpreter when the decorator runs, so this module must be imported
before the kernel modules (``kernels/__init__.py`` imports it first). Without a GPU, Triton can
only run through its interpreter, so we turn it on; an explicit ``TRITON_INTERPRET`` wins.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

#: True when kernels run under the Triton interpreter (numpy on the CPU), not compiled.
INTERPRETED: bool = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
