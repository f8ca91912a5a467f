"""Every trace layer and the event names more than one module uses, defined once.

The engine emits them, the tracer folds and filters them, the TUI shows them: a typo in one
of those places would silently drop an event from a panel, so they import these instead of
repeating the strings.
"""
from __future__ import annotations

# layers, outermost first; "tracer" is the tracer's own voice (pauses, events a reader missed)
CLI, HTTP, API, TOKENIZER, IPC, ENGINE = "cli", "http", "api", "tokenizer", "ipc", "engine"
SCHEDULER, BLOCK_MANAGER, MODEL_RUNNER, KERNEL = "scheduler", "block_manager", "model_runner", "kernel"
SAMPLER, DETOKENIZER, TRACER = "sampler", "detokenizer", "tracer"
LAYERS = (CLI, HTTP, API, TOKENIZER, IPC, ENGINE, SCHEDULER, BLOCK_MANAGER, MODEL_RUNNER, KERNEL, SAMPLER,
          DETOKENIZER, TRACER)
# where each runs with the engine core in its own process (in one process: all here)
FRONTEND_LAYERS = frozenset({CLI, HTTP, API, TOKENIZER, DETOKENIZER})

# the scheduler's step: begin, snapshot (the queues and the batch), end
SCHEDULE = "schedule"
# request lifecycle (engine, scheduler)
QUEUED, SCHEDULED, PREEMPTED, FINISHED, ABORTED = "QUEUED", "SCHEDULED", "PREEMPTED", "FINISHED", "ABORTED"
NEW_TOKENS = "NEW_TOKENS"  # detokenizer
PAUSED, RESUMED = "paused", "resumed"  # tracer: the step controller holds / lets go of the engine
# ipc: one event per message across the process boundary (type, request ids, bytes)
IPC_SEND, IPC_RECV, CORE_DIED = "send", "recv", "core_died"
# startup stages of the engine-core process, traced by the front end (cli layer)
CORE_PROCESS_START, CORE_HANDSHAKE = "core_process_start", "core_handshake"
