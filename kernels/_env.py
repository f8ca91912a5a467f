"""Decide, before any kernel is decorated, whether Triton runs natively or interpreted.

``triton.jit`` picks the interpreter when the decorator runs, so this module must be imported
before the kernel modules (``kernels/__init__.py`` imports it first). Without a GPU, Triton can
only run through its interpreter, so we turn it on; an explicit ``TRITON_INTERPRET`` wins.

Someone may have imported triton before us with the interpreter off: transformers does, as it
loads a model (a notebook that compares with transformers first). Triton's own library
functions (``tl.sum``, ``tl.max``, ``tl.cdiv``) were then decorated as compiled functions, and
an interpreted kernel that calls one dies with "Cannot call @triton.jit'd outside of the scope
of a kernel". So we import triton's Python modules again, under the interpreter: its compiled
extension (``triton._C``) is kept, and whoever imported triton first keeps the copy it has.
"""
import ctypes
import os
import sys

import torch

_ON = ("1", "true", "on", "yes")

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

#: True when kernels run under the Triton interpreter (numpy on the CPU), not compiled.
INTERPRETED: bool = os.environ.get("TRITON_INTERPRET", "0").lower() in _ON


def _reimport_triton_interpreted() -> bool:
    """Import triton's Python modules again if they were loaded with the interpreter off (see the
    module docstring); returns whether it had to."""
    loaded = sys.modules.get("triton.runtime.jit")
    if loaded is None or not INTERPRETED:
        return False
    from triton.runtime.interpreter import InterpretedFunction

    standard = sys.modules.get("triton.language.standard")
    if standard is None or isinstance(getattr(standard, "sum", None), InterpretedFunction):
        return False  # imported with the interpreter on already, or not as far as its library
    python_modules = [n for n in sys.modules if n.split(".")[0] == "triton" and not n.startswith("triton._C")]
    for name in python_modules:
        del sys.modules[name]
    import triton.language  # noqa: F401  (decorated again, interpreted now)

    return True


TRITON_REIMPORTED: bool = _reimport_triton_interpreted()


def _single_threaded_numpy_blas() -> bool:
    """Run numpy's OpenBLAS on one thread; returns whether it could.

    The interpreter's tl.dot is np.matmul on tiles of a few thousand elements: extra BLAS
    threads cannot speed that up, and they spin-wait against every other busy process. On a
    shared 2-core machine that made a decode step 3-4x slower (CPU time 460 ms vs 176 ms).
    numpy is already loaded by torch, so OPENBLAS_NUM_THREADS would come too late; we call
    the bundled OpenBLAS directly. Torch's own CPU threads are not affected.
    """
    if os.environ.get("KERNELS_KEEP_BLAS_THREADS"):
        return False
    try:
        import numpy as np

        lib = ctypes.CDLL(np._core._multiarray_umath.__file__)  # OpenBLAS is among its dependencies
        for name in ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads", "openblas_set_num_threads"):
            if hasattr(lib, name):
                getattr(lib, name)(1)
                return True
    except (AttributeError, ImportError, OSError):
        pass
    return False


NUMPY_BLAS_SINGLE_THREADED: bool = INTERPRETED and _single_threaded_numpy_blas()
