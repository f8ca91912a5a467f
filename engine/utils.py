"""Small helpers shared by the engine's process launchers."""
from __future__ import annotations

import os

import engine

# The private directory (0700) of the process that owns this engine's sockets: the engine-core
# process sets it to its front end's, so that the sockets it binds for its tensor-parallel workers
# live there too and go with it whatever way the core ends (kill -9 included: the front end
# removes its directory).
RUNTIME_DIR_ENV = "VLLM_TRACE_RUNTIME_DIR"


def child_pythonpath() -> str:
    """This checkout first, so a child process (the engine core, a tensor-parallel worker) runs the
    same engine code as its parent, whatever is installed."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(engine.__file__)))
    return os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])


def runtime_dir() -> str | None:
    """Where a process should create its socket directories (None: the system's temporary dir)."""
    path = os.environ.get(RUNTIME_DIR_ENV)
    return path if path and os.path.isdir(path) else None
