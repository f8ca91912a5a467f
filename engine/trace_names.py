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
SPEC_DECODE = "spec_decode"  # speculative decoding: drafts verified, accepted, rejected
WORKER = "worker"  # a tensor-parallel rank's own process (its startup, the step it received)
STRUCTURED_OUTPUT = "structured_output"  # the engine core's StructuredOutputManager: grammars and their masks
PROFILER = "profiler"  # profiling on demand: its window (start, stop); the profiled ops are kernel launches
KV_TRANSFER = "kv_transfer"  # a KV connector's transfers: blocks saved, loaded, sent, received
LAYERS = (CLI, HTTP, API, TOKENIZER, IPC, ENGINE, SCHEDULER, STRUCTURED_OUTPUT, BLOCK_MANAGER, WORKER, MODEL_RUNNER,
          KERNEL, SAMPLER, SPEC_DECODE, DETOKENIZER, PROFILER, KV_TRANSFER, TRACER)
# where each runs with the engine core in its own process (in one process: all here)
FRONTEND_LAYERS = frozenset({CLI, HTTP, API, TOKENIZER, DETOKENIZER})

# event names the tracer folds, filters or draws, by layer
CONFIG, STEP = "config", "step"  # engine: its configuration at startup; one engine step (a span)
BATCH_QUEUE = "batch_queue"  # engine, async scheduling: what one step_with_batch_queue call did (an instant)
UPDATE_FROM_OUTPUT = "update_from_output"  # scheduler, async scheduling: a step's outputs applied (a span)
ENCODE = "encode"  # tokenizer
FAN_OUT = "fan_out"  # api: a request with n > 1 became n child requests (parallel sampling)
SCHEDULE = "schedule"  # scheduler: a span, with a snapshot (the queues and the batch) before its end
ALLOCATE, FREE, EVICT, CACHE_HIT, CACHE_MISS = "allocate", "free", "evict", "cache_hit", "cache_miss"  # block_manager
FREE_WINDOW = "free_window"  # block_manager: blocks a sliding window has passed, back to the pool
BATCH = "batch"  # model_runner: the step's flattened batch
ROUTING = "routing"  # model_runner: one MoE layer's routing in a step (tokens per expert, each token's top-k)
EXECUTE_MODEL, WORKER_READY = "execute_model", "ready"  # worker: the step it received; up and serving
ALL_REDUCE, ALL_GATHER = "all_reduce", "all_gather"  # kernel: tensor-parallel collectives, traced as launches
REDUCE_SCATTER = "reduce_scatter"  # kernel: expert parallelism's combine (engine/distributed/all2all.py)
SAMPLED = "sampled"  # sampler
PROFILE_START, PROFILE_STOP = "start", "stop"  # profiler: step = the first / the last profiled step
VERIFIED, REJECTED = "verified", "rejected"  # spec_decode: a request's drafts checked; some were rejected
DRAFT_PREFIX = "draft:"  # kernel events of a draft model's forward passes: "draft:unified_attention", ...
# structured_output: a request's grammar compiled (or failed); a step's bitmask (allowed tokens per request);
# a sampled token the grammar refused
GRAMMAR_COMPILED, BITMASK, GRAMMAR_REJECTED = "compiled", "bitmask", "refused"
DRAFTS_VALIDATED = "drafts_validated"  # structured_output: a request's drafts checked by its grammar (prefix kept)
# kv_transfer: per request and step, its blocks written to / read from the connector's store, sent to /
# received from another instance (block ids, bytes, seconds)
KV_SAVE, KV_LOAD, KV_SEND, KV_RECV = "save", "load", "send", "recv"
EVENTS_LOST = "events_lost"  # tracer: a reader fell behind the ring and missed this many events
# request lifecycle (engine, scheduler)
QUEUED, SCHEDULED, PREEMPTED, FINISHED, ABORTED = "QUEUED", "SCHEDULED", "PREEMPTED", "FINISHED", "ABORTED"
NEW_TOKENS = "NEW_TOKENS"  # detokenizer
PAUSED, RESUMED = "paused", "resumed"  # tracer: the step controller holds / lets go of the engine
# ipc: one event per message across the process boundary (type, request ids, bytes)
IPC_SEND, IPC_RECV, CORE_DIED = "send", "recv", "core_died"
# startup stages of the engine-core process, traced by the front end (cli layer)
CORE_PROCESS_START, CORE_HANDSHAKE = "core_process_start", "core_handshake"

# kernel launches: the kernels that stand in for one of ours (kernel:NAME breakpoints stop at them too): its
# PyTorch reference (attention_backend=torch), and on a CPU the C kernel of kernels/cpu (attention_backend=cpu)
KERNEL_STAND_INS = {"unified_attention": ("unified_attention_ref", "cpu_attention_with_kv_cache"),
                    "gumbel_sample": ("gumbel_sample_ref", "gumbel_sample_cpu")}
ATTENTION_KERNELS = frozenset({"unified_attention", *KERNEL_STAND_INS["unified_attention"]})


def is_attention_kernel(name: object) -> bool:
    """Whether a launch's name is the target model's attention kernel's (any backend's)."""
    return str(name) in ATTENTION_KERNELS
