"""Small helpers shared by the engine's process launchers."""
from __future__ import annotations

import os

import engine


def child_pythonpath() -> str:
    """This checkout first, so a child process (the engine core, a tensor-parallel worker) runs the
    same engine code as its parent, whatever is installed."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(engine.__file__)))
    return os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])
