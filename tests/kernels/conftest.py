"""Kernel tests run under the Triton interpreter when there is no GPU.

The variable must be set before `triton.jit` decorates the kernels; `import kernels` does the same,
this just makes the tests independent of import order.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
