"""Freezing the startup heap, as vLLM does once its engine is up (its ``freeze_gc_heap``).

Python's full (oldest-generation) collection walks every container object that has survived
two collections: after startup, all of torch, transformers and the model in an engine, all of
FastAPI and Textual in a front end. Measured: 130-180 ms a full collection in an engine with
transformers imported; in the front end of benchmarks.two_processes' TUI run (64 streams, the
Requests pane, 2 cores), 255,000 objects and a full collection every ~0.7 s that held the event
loop 275-400 ms, which is where most of the TUI's missed refreshes went. Torch-free: the API
server imports it.
"""
from __future__ import annotations

import atexit
import gc


def freeze_gc_heap() -> None:
    """Collect, then move every object alive now into the collector's permanent generation, which
    collections skip. Later objects are collected as usual; a frozen one is still freed when
    nothing refers to it. Call it once startup is over."""
    gc.collect()
    gc.freeze()
    atexit.unregister(gc.unfreeze)  # once, however many times a process freezes
    atexit.register(gc.unfreeze)  # at exit everything is collectable again, so it is torn down cleanly
