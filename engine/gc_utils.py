"""Freezing the startup heap, as vLLM does once its engine is up (its ``freeze_gc_heap``).

Python's full (oldest-generation) collection walks every container object that has survived
two collections: after startup, all of torch, transformers and the model in an engine, all of
FastAPI and Textual in a front end. Measured: 130-180 ms a full collection in an engine with
transformers imported; in the front end of benchmarks.two_processes' TUI run (64 streams, the
Requests pane, 2 cores), 255,000 objects and a full collection every ~0.7 s that held the event
loop 275-400 ms, which is where most of the TUI's missed refreshes went. Torch-free: the API
server imports it.

A busy front end also raises the young generation's threshold (``raise_young_threshold``): with
the TUI folding 64 streams' trace, every refresh decodes ~800 events (~10,000 containers), and at
Python's 700 a collection ran every few dozen events, walking events that the next line would
free and promoting them to the older generations, which full collections walk again. At 20,000
a refresh's events are freed before a collection sees them: the TUI's main thread went from
27.3 to 22.9 ms of CPU a refresh (headless, Requests panel, 64 streams, two runs of five each);
5,000 gave 26.6, 50,000 23.4.
"""
from __future__ import annotations

import atexit
import gc
import sys


def freeze_gc_heap() -> None:
    """Collect, then move every object alive now into the collector's permanent generation, which
    collections skip. Later objects are collected as usual; a frozen one is still freed when
    nothing refers to it. Call it once startup is over."""
    gc.collect()
    gc.freeze()
    atexit.unregister(gc.unfreeze)  # once, however many times a process freezes
    atexit.register(gc.unfreeze)  # at exit everything is collectable again, so it is torn down cleanly


YOUNG_THRESHOLD = 20_000  # objects allocated (net) between young collections; Python's default is 700


def raise_young_threshold(threshold: int = YOUNG_THRESHOLD) -> None:
    """Collect the young generation every `threshold` allocations (the older generations' own
    thresholds unchanged). For a process that allocates many short-lived containers: see above."""
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(max(threshold, 1), older, oldest)


def free_dropped_engines() -> None:
    """Give back the memory of engines nothing holds any more (an LLM dropped without shutdown()): thaw the
    heap (an in-process engine is a cycle, and a frozen cycle is never collected), collect, and hand torch's
    cached CUDA memory back to the driver (cached segments cut for another model's tensor sizes would not
    fit the next engine's: on an H200 a second LLM's KV cache failed at its 10th 10.4 GiB tensor with
    42 GiB cached). The heap is frozen again once the next engine is built (freeze_gc_heap)."""
    gc.unfreeze()
    gc.collect()
    torch = sys.modules.get("torch")  # imported already where an engine ran in this process
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()
