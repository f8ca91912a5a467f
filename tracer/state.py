"""The engine's visible state, rebuilt from events by one fold function.

``fold(state, event)`` is the only place that knows how an event changes what a viewer sees.
Replay (from a trace file, forward and backward) and ``LiveState`` (from the bus, for the TUI
and ``/trace/state``) both use it, so they cannot drift apart.

The engine's schedule snapshot is the source of truth: at every step it *replaces* the queues,
block tables and token counts (they are the engine's own structures, copied at schedule time).
Between snapshots the fold applies what happened since: arrivals (also while paused), tokens,
finishes, frees, so the view is current at every event, not just once a step.

A live server runs for days: with ``max_finished`` set (LiveState sets MAX_FINISHED unless
told otherwise; ``serve --trace-max-finished``), only that many finished requests are kept,
the oldest dropped as new ones finish, and a request refused before it reached the engine
(a 400) is dropped when its HTTP response ends. The recorder's trace file keeps everything;
a replay folds with no limit. Measured before the limit: 2,200 requests made /trace/state
3 MB and ~1 s to build, and RSS grew ~100 MB per 2,000 traced requests.
"""
from __future__ import annotations

import copy
import dataclasses
import threading
from dataclasses import dataclass, field

import orjson

from engine.hooks import BEGIN, COUNTER, END, SNAPSHOT
from engine.trace_names import (
    ABORTED,
    ALLOCATE,
    API,
    BATCH,
    BATCH_QUEUE,
    BITMASK,
    BLOCK_MANAGER,
    CACHE_HIT,
    CACHE_MISS,
    CLI,
    CONFIG,
    CORE_DIED,
    DETOKENIZER,
    DRAFTS_VALIDATED,
    ENCODE,
    ENGINE,
    EVENTS_LOST,
    EVICT,
    EXECUTE_MODEL,
    FAN_OUT,
    FINISHED,
    FREE,
    FREE_WINDOW,
    GRAMMAR_COMPILED,
    HTTP,
    IPC,
    KERNEL,
    KV_TRANSFER,
    MODEL_RUNNER,
    NEW_TOKENS,
    PAUSED,
    PREEMPTED,
    PROFILE_START,
    PROFILE_STOP,
    PROFILER,
    QUEUED,
    RESUMED,
    ROUTING,
    SAMPLED,
    SAMPLER,
    SCHEDULE,
    SCHEDULED,
    SCHEDULER,
    SPEC_DECODE,
    STEP,
    STRUCTURED_OUTPUT,
    TOKENIZER,
    TRACER,
    UPDATE_FROM_OUTPUT,
    VERIFIED,
    WORKER,
    WORKER_READY,
)
from tracer.bus import EventBus
from tracer.events import Event, json_safe

MAX_FINISHED = 256  # finished requests a live state keeps (the TUI lists the latest 100)
FOLLOW_INTERVAL = 0.1  # s between folds of a LiveState that follows the bus by itself


@dataclass
class RequestView:
    request_id: str
    status: str = "WAITING"  # WAITING, RUNNING, PREEMPTED, FINISHED_STOPPED / _LENGTH / _ABORTED
    num_prompt_tokens: int = 0
    num_tokens: int = 0
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    max_tokens: int | None = None
    prompt_token_ids: list[int] = field(default_factory=list)
    prompt_pieces: list[str] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    # Tokens generated, counted by the engine's FINISHED too: with the engine core in its own
    # process, a request held at a finish breakpoint has finished in the core while its last
    # token (NEW_TOKENS, from the API server) is still to come, so output_token_ids is one short.
    num_output_tokens: int = 0
    text: str = ""  # generated text so far
    block_table: list[int] = field(default_factory=list)
    # a hybrid model (sliding-window and full-attention layers): one table per KV-cache group, the null
    # block (0) where a window has passed; empty for one group (block_table is its table)
    kv_block_tables: list[list[int]] = field(default_factory=list)
    finish_reason: str | None = None
    preempt_reason: str | None = None
    waiting_reason: str | None = None  # why the scheduler did not admit it this step
    arrival_step: int | None = None
    finished_step: int | None = None
    arrival_ns: int | None = None  # ts_ns of QUEUED (trace time: ns since the trace started)
    finished_ns: int | None = None
    layers: list[str] = field(default_factory=list)  # the layers it has passed through, in order
    # Its journey, one entry per thing that happened to it: {"event", "step", "ts_ns", ...}:
    # QUEUED, SCHEDULED, prefill (a chunk: "tokens"), decode (a run of consecutive decode steps:
    # "steps", "last_step"), PREEMPTED, FINISHED / ABORTED. Decode runs are merged so a long
    # generation stays a short list (the TUI clones the state ten times a second).
    timeline: list[dict] = field(default_factory=list)
    cache_hit_blocks: list[int] = field(default_factory=list)  # prefix-cache hits, physical ids
    priority: int = 0  # with scheduling_policy "priority": lower first
    seed: int | None = None  # its sampling seed (the user's, else the engine's pick): draws keyed by (seed, position)
    worker_slot: int | None = None  # its row in the worker's persistent batch, when it last ran (model_runner batch)
    spec_history: list[tuple[int, int, int]] = field(default_factory=list)  # (step, drafts, accepted), recent
    parent_id: str | None = None  # n > 1: the request this one is a child of
    sibling_ids: list[str] = field(default_factory=list)  # n > 1: all the children, in index order
    # structured outputs: the grammar's kind (json, regex, choice, ...), its compile time, and per
    # generated token how many tokens the grammar's mask allowed when it was sampled
    grammar: str | None = None
    grammar_compile_s: float | None = None
    num_allowed: list[int] = field(default_factory=list)
    grammar_pieces: list[str] = field(default_factory=list)  # the text each output step added (structured only)
    # a KV connector's transfers of its blocks (kv_transfer events), oldest first: {"kind" (save, load, send,
    # recv), "step", "ts_ns", "block_ids", "bytes", "seconds", "connector"}; the kv_transfer_params it came with
    # (disaggregated prefill: do_remote_decode on the prefill instance; remote_engine_id, remote_request_id, ...
    # on the decode instance); and its latest lookup's hit in this instance's own prefix cache (num_cached_tokens
    # adds the tokens a connector delivered)
    kv_transfers: list[dict] = field(default_factory=list)
    kv_transfer_params: dict | None = None
    prefix_hit_tokens: int = 0

    def copy(self) -> "RequestView":
        c = copy.copy(self)
        for name in ("prompt_token_ids", "prompt_pieces", "output_token_ids", "block_table", "kv_block_tables",
                     "layers", "cache_hit_blocks", "spec_history", "num_allowed", "grammar_pieces", "kv_transfers"):
            setattr(c, name, list(getattr(self, name)))
        c.timeline = [dict(t) for t in self.timeline]  # fold extends the last decode entry in place
        return c


@dataclass
class TraceState:
    step: int | None = None  # the step in progress (or last finished)
    phase: str = "idle"  # startup, idle, schedule, execute, postprocess, done (the step has ended)
    requests: dict[str, RequestView] = field(default_factory=dict)
    waiting: list[str] = field(default_factory=list)
    running: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)  # in finish order (the latest max_finished)
    num_finished: int = 0  # all that ever finished, dropped ones included
    max_finished: int | None = None  # None: keep every finished request (a replay)
    snapshot: dict | None = None  # the latest schedule snapshot, exactly as recorded
    snapshot_step: int | None = None
    batch: dict | None = None  # this step's flattened model input
    kernels: list[dict] = field(default_factory=list)  # this step's kernel launches (name, grid, rank, ...)
    sampled: dict | None = None  # this step's sampled token ids
    verified: dict = field(default_factory=dict)  # speculative decoding: request id -> this step's verification
    # structured outputs with speculation: step -> request id -> its grammar's check of the drafts that step
    # verifies ("draft" proposed, "kept", "cut"); made at the end of the step before, kept while it is shown
    drafts_cut: dict = field(default_factory=dict)
    grammar_mask: dict | None = None  # this step's grammar bitmask: allowed tokens per request, vocab_size, fill_ns
    # a mixture of experts: the latest step's routing (routing_step), per decoder layer its routing event
    # (expert_counts, rank_counts, each request's tokens' topk_ids and topk_weights); replaced, never changed in place
    routing: dict = field(default_factory=dict)
    routing_step: int | None = None
    stats: dict = field(default_factory=dict)  # latest EngineStats
    num_blocks: int | None = None
    startup: list[dict] = field(default_factory=list)  # finished startup stages
    startup_current: dict | None = None  # the stage in progress: {"stage", "ts_ns", ...its details}
    # Free blocks whose contents are still in the prefix cache (a new request may hit them;
    # taking one for something else evicts it). The engine's free events do not say which
    # freed blocks were hashed, so the fold derives it: a block is hashed once it is full of
    # computed tokens (see _freed); tests check this against the block pool.
    cached_free: set[int] = field(default_factory=set)
    kv_usage_history: list[float] = field(default_factory=list)  # KV-cache use at each step's end
    kernel_history: dict[str, list[int]] = field(default_factory=dict)  # name -> ns per step (all layers)
    # Tensor parallelism: N ranks (config.parallel; 1 for an old trace). workers[r] is rank r's
    # worker: its startup stages by name ({"model_load": END attrs, "kv_cache_alloc": ...}),
    # "ready", and "execute_model", the step it received last. A list, not a dict: the
    # state goes through JSON (attach), where int keys would come back as strings.
    tensor_parallel_size: int = 1
    workers: list[dict] = field(default_factory=list)
    last_ts_ns: int = 0  # trace time of the latest event: "now" for a replay
    engine_config: dict | None = None
    paused_at: dict | None = None  # where the step controller holds the engine, if it does
    num_events: int = 0
    events_missed: int = 0
    last_seq: int | None = None
    engine_dead: str | None = None  # why the engine core died ("engine core died: signal 9"), once it has
    # profiling on demand (/start_profile): every op of the forward pass is a launch while it is on
    profiling: bool = False
    profiler_dir: str | None = None  # where torch.profiler writes the same window, if asked
    step_start_ns: int | None = None  # trace time the step in progress began
    step_ns: int | None = None  # wall time of the last step that ended
    # async scheduling: the steps scheduled whose outputs are not in yet, oldest first, as [step, status]
    # (status: scheduled, executing, sampled); the step shown (`step`) is the newest. older_kernels: the
    # launches of the step before it, which may still run (its forward pass overlaps the next schedule)
    in_flight: list[list] = field(default_factory=list)
    done_step: int | None = None  # the last step whose outputs are in (under async scheduling `step` may be ahead)
    last_call: dict | None = None  # async scheduling: what the last step_with_batch_queue call did
    # the two rows of the timeline, the latest TIMELINE_SPANS spans: [row, name, step, begin_ns, end_ns (None:
    # open)], row "core" (schedule, grammar_bitmask, update_from_output) or "forward" (execute_model)
    timeline: list[list] = field(default_factory=list)
    # the requests each step in flight samples for, [[step, [request ids]]]: their tokens are placeholders
    pending: list[list] = field(default_factory=list)
    older_kernels: list[dict] = field(default_factory=list)
    older_snapshot: dict | None = None  # ... and its schedule snapshot
    # the newest step that ran a batch, once its outputs were in: {"step", "snapshot", "kernels"} (under async
    # scheduling the last step is often one that scheduled nothing: the Overview shows this one then)
    last_batch: dict | None = None

    @property
    def kv_cache_usage(self) -> float:
        total = self.stats.get("num_total_blocks") or self.num_blocks
        return 1.0 - self.stats["num_free_blocks"] / total if total and "num_free_blocks" in self.stats else 0.0

    def request(self, request_id: str) -> RequestView:
        req = self.requests.get(request_id)
        if req is None:
            req = self.requests[request_id] = RequestView(request_id)
        return req

    def to_dict(self) -> dict:
        """Plain JSON data (what /trace/state serves); live-only objects are left out."""
        d = json_safe(self)
        d["kv_cache_usage"] = self.kv_cache_usage
        return d

    def to_json(self, **extra) -> bytes:
        """``{"state": to_dict(), **extra}`` as JSON, straight from the dataclasses with orjson
        (json_safe only for what orjson refuses): 256 finished requests in ~3 ms, not ~40 ms."""
        try:
            return orjson.dumps({"state": self, **extra}, default=_plain_fields,
                                option=orjson.OPT_PASSTHROUGH_DATACLASS | orjson.OPT_NON_STR_KEYS)
        except TypeError:  # an integer past 64 bits, a lone surrogate: the slow, total path
            return orjson.dumps({"state": self.to_dict(), **json_safe(extra)})

    def clone(self) -> "TraceState":
        """An independent copy. Cheaper than deepcopy (a TUI clones ten times a second): the
        dicts that come from events (snapshot, batch, ...) are shared, since fold never changes
        an event's attributes; everything fold does change is copied."""
        c = copy.copy(self)
        c.requests = {rid: r.copy() for rid, r in self.requests.items()}
        c.waiting, c.running, c.finished = list(self.waiting), list(self.running), list(self.finished)
        c.kernels, c.startup, c.stats = list(self.kernels), list(self.startup), dict(self.stats)
        c.in_flight, c.older_kernels = [list(f) for f in self.in_flight], list(self.older_kernels)
        c.timeline, c.pending = [list(t) for t in self.timeline], list(self.pending)
        c.cached_free, c.kv_usage_history = set(self.cached_free), list(self.kv_usage_history)
        c.verified, c.drafts_cut = dict(self.verified), {step: dict(cut) for step, cut in self.drafts_cut.items()}
        c.kernel_history = {k: list(v) for k, v in self.kernel_history.items()}
        c.workers = [dict(w) for w in self.workers]  # fold replaces a worker's values, never changes them
        return c

    @classmethod
    def from_dict(cls, d: dict) -> "TraceState":
        """The inverse of to_dict (what `vllm-trace attach` gets from /trace/state)."""
        d = dict(d)
        d.pop("kv_cache_usage", None)  # a property
        known = {f.name for f in dataclasses.fields(cls)}
        state = cls(**{k: v for k, v in d.items() if k in known})
        rfields = {f.name for f in dataclasses.fields(RequestView)}
        state.requests = {rid: RequestView(**{k: v for k, v in r.items() if k in rfields})
                          for rid, r in d.get("requests", {}).items()}
        state.cached_free = set(d.get("cached_free", ()))
        return state


def _plain_fields(x):
    if isinstance(x, TraceState):
        return {f.name: getattr(x, f.name) for f in _STATE_FIELDS} | {"kv_cache_usage": x.kv_cache_usage}
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {f.name: getattr(x, f.name) for f in dataclasses.fields(x)}
    return json_safe(x)


_STATE_FIELDS = dataclasses.fields(TraceState)


def fold(state: TraceState, ev: Event) -> TraceState:
    """Apply one event to the state (in place) and return it."""
    state.num_events += 1
    state.last_seq = ev.seq
    state.last_ts_ns = max(state.last_ts_ns, ev.ts_ns)
    if ev.request_id is not None:
        req = state.requests.get(ev.request_id)
        if req is None:
            if ev.layer in (HTTP, API) and ev.kind != BEGIN and not ev.name.endswith("_request") \
                    or ev.layer == KV_TRANSFER:
                return state  # the response's last words (or its KV's last send) after it was dropped
            req = state.request(ev.request_id)
        if not req.layers or req.layers[-1] != ev.layer:
            req.layers.append(ev.layer)
    handler = _HANDLERS.get((ev.layer, ev.name)) or _LAYER_HANDLERS.get(ev.layer)
    if handler is not None:
        handler(state, ev)
    return state


def _attrs(ev: Event) -> dict:
    return ev.attrs or {}


# ---- engine -------------------------------------------------------------------------------
def _config(s: TraceState, ev: Event) -> None:
    s.engine_config = _attrs(ev).get("config")
    s.phase = "startup"
    s.tensor_parallel_size = int(((s.engine_config or {}).get("parallel") or {}).get("tensor_parallel_size") or 1)


def _startup_stage(s: TraceState, ev: Event) -> None:
    if ev.kind == END:
        a = _attrs(ev)
        s.startup.append({"stage": ev.name, **a})
        if ev.name == "kv_cache_alloc" and "num_blocks" in a:
            s.num_blocks = a["num_blocks"]
        if a.get("tensor_parallel_size"):
            s.tensor_parallel_size = a["tensor_parallel_size"]


def _queued(s: TraceState, ev: Event) -> None:
    a, req = _attrs(ev), s.request(ev.request_id)
    req.status = "WAITING"
    req.num_prompt_tokens = req.num_tokens = a.get("num_prompt_tokens", 0)
    req.max_tokens = a.get("max_tokens")
    req.priority = a.get("priority", 0)
    req.seed = a.get("seed")
    req.kv_transfer_params = ((a.get("params") or {}).get("extra_args") or {}).get("kv_transfer_params")
    req.arrival_step, req.arrival_ns = ev.step, ev.ts_ns
    req.timeline.append({"event": QUEUED, "step": ev.step, "ts_ns": ev.ts_ns})
    if ev.request_id not in s.waiting:
        s.waiting.append(ev.request_id)


def _verified(s: TraceState, ev: Event) -> None:
    a, req = _attrs(ev), s.request(ev.request_id)
    s.verified[ev.request_id] = a
    _append_bounded(req.spec_history, (ev.step, len(a.get("draft", ())), len(a.get("accepted", ()))))


def _fan_out(s: TraceState, ev: Event) -> None:
    a = _attrs(ev)
    children = list(a.get("child_ids", ()))
    for cid in children:
        child = s.request(cid)
        child.parent_id, child.sibling_ids = a.get("parent_id"), children


def _encoded(s: TraceState, ev: Event) -> None:
    a, req = _attrs(ev), s.request(ev.request_id)
    req.prompt_token_ids, req.prompt_pieces = list(a.get("token_ids", [])), list(a.get("pieces", []))


def _finished(s: TraceState, ev: Event) -> None:
    a, rid = _attrs(ev), ev.request_id
    req = s.request(rid)
    if ev.name == ABORTED:
        req.status, req.finish_reason = "FINISHED_ABORTED", "abort"
    else:
        req.finish_reason = a.get("finish_reason")
        req.status = {"stop": "FINISHED_STOPPED", "length": "FINISHED_LENGTH"}.get(req.finish_reason, FINISHED)
        req.num_output_tokens = max(req.num_output_tokens, a.get("num_output_tokens") or 0)
        if a.get("text") is not None:  # authoritative: a stop string may have cut the tail
            req.text = a["text"]
        # else the core's (its own process: no text there), which comes before the API server's
        # NEW_TOKENS for the same step: the text is theirs, earlier and later alike
    req.finished_step, req.finished_ns = ev.step, ev.ts_ns
    req.timeline.append({"event": ev.name, "step": ev.step, "ts_ns": ev.ts_ns, "reason": req.finish_reason})
    req.block_table = []
    for q in (s.waiting, s.running):
        if rid in q:
            q.remove(rid)
    s.finished.append(rid)
    s.num_finished += 1
    trim_finished(s)


def trim_finished(s: TraceState) -> None:
    """Drop the oldest finished requests beyond max_finished."""
    excess = len(s.finished) - s.max_finished if s.max_finished is not None else 0
    if excess > 0:
        for rid in s.finished[:excess]:
            if rid not in s.waiting and rid not in s.running:  # (an id reused: it lives again)
                s.requests.pop(rid, None)
        del s.finished[:excess]


def _http(s: TraceState, ev: Event) -> None:
    """A response that ends for a request that never reached the engine (refused, or the
    parent of a multi-prompt completion, whose prompts run as their own requests)."""
    if ev.kind == END and ev.request_id is not None:
        req = s.requests.get(ev.request_id)
        if req is not None and not req.timeline and ev.request_id not in s.waiting and ev.request_id not in s.running:
            del s.requests[ev.request_id]


def _step(s: TraceState, ev: Event) -> None:
    if ev.kind == BEGIN:
        older = any(f[0] == s.step for f in s.in_flight)
        s.older_kernels = s.kernels if older else []
        s.older_snapshot = s.snapshot if older and s.snapshot_step == s.step else None
        s.in_flight.append([ev.step, "scheduled"])
        s.step, s.phase, s.step_start_ns, s.step_ns = ev.step, "schedule", ev.ts_ns, None
        s.batch, s.kernels, s.sampled, s.verified, s.grammar_mask = None, [], None, {}, None
        if s.drafts_cut:
            s.drafts_cut = {step: cut for step, cut in s.drafts_cut.items() if step >= ev.step}
    elif ev.kind == END:
        older = _older(s, ev.step)
        s.in_flight, s.done_step = [f for f in s.in_flight if f[0] != ev.step], ev.step
        s.pending = [p for p in s.pending if p[0] != ev.step]
        s.stats = _attrs(ev).get("stats", s.stats)
        _append_bounded(s.kv_usage_history, s.kv_cache_usage)
        if older:  # async scheduling: an older step's outputs, while the step shown is in flight
            _kernel_history(s, s.older_kernels)
            _last_batch(s, ev.step, s.older_snapshot, s.older_kernels)
            s.older_kernels, s.older_snapshot = [], None
            return
        s.phase = "done"
        if s.step_start_ns is not None:
            s.step_ns = ev.ts_ns - s.step_start_ns
        _kernel_history(s, s.kernels)
        _last_batch(s, ev.step, s.snapshot if s.snapshot_step == ev.step else None, s.kernels)
        # what postprocess did: every token scheduled this step is now computed
        if s.snapshot is not None and s.snapshot_step == ev.step:
            for sch in s.snapshot.get("scheduled", []):
                req = s.requests.get(sch["request_id"])
                if req is not None and not req.status.startswith(FINISHED):
                    req.num_computed_tokens = sch["num_computed_before"] + sch["num_tokens"]


def _last_batch(s: TraceState, step: int, snapshot: dict | None, kernels: list[dict]) -> None:
    if snapshot is not None and snapshot.get("scheduled"):
        s.last_batch = {"step": step, "snapshot": snapshot, "kernels": list(kernels)}


IN_FLIGHT = ("scheduled", "executing", "sampled")  # a step in flight, in order


def _older(s: TraceState, step: int | None) -> bool:
    """Async scheduling: is `step` in flight behind the step shown (its events come after the next one began)?"""
    return step != s.step and any(f[0] == step for f in s.in_flight)


TIMELINE_SPANS = 48  # about the last eight steps: schedule, bitmask, update and forward pass each


def _span(s: TraceState, ev: Event, row: str, duration_ns: int | None) -> None:
    """A span on the timeline: opened by BEGIN, closed by END; an instant of duration_ns (ending now)."""
    if (_attrs(ev).get("rank") or 0) != 0:
        return  # rank 0's forward pass stands for every rank's
    if ev.kind == END:
        for t in reversed(s.timeline):
            if t[:3] == [row, ev.name, ev.step] and t[4] is None:
                t[4] = ev.ts_ns
                return
        return
    begin = ev.ts_ns - duration_ns if duration_ns else ev.ts_ns
    s.timeline.append([row, ev.name, ev.step, begin, ev.ts_ns if ev.kind != BEGIN else None])
    del s.timeline[:-TIMELINE_SPANS]


def _pending(s: TraceState, ev: Event, snap: dict) -> None:
    """The requests this step samples for (a decode, or a prefill's last chunk): placeholders until its end."""
    known = {r["request_id"]: r["num_tokens"] for r in snap.get("running", [])}
    samples = [r["request_id"] for r in snap.get("scheduled", [])
               if r["num_computed_before"] + r["num_tokens"] >= known.get(r["request_id"], 0)]
    s.pending = [p for p in s.pending if p[0] != ev.step] + [[ev.step, samples]]


def placeholders(s: TraceState, request_id: str) -> int:
    """How many of a request's tokens are in flight (async scheduling), not known yet."""
    return sum(request_id in rids for step, rids in s.pending)


def _batch_queue(s: TraceState, ev: Event) -> None:
    a = _attrs(ev)
    s.last_call = {"scheduled": a.get("scheduled"), "executed": a.get("executed")}


def _in_flight(s: TraceState, step: int | None, status: str) -> None:
    for f in s.in_flight:
        if f[0] == step and IN_FLIGHT.index(f[1]) < IN_FLIGHT.index(status):
            f[1] = status


def _kernel_history(s: TraceState, kernels: list[dict]) -> None:
    per_name: dict[str, int] = {}
    for k in kernels:
        if k.get("rank", 0) != 0:
            continue  # the sparklines follow rank 0: the same work on every rank, not N times over
        per_name[k["name"]] = per_name.get(k["name"], 0) + (k.get("duration_ns") or 0)
    for name, ns in per_name.items():
        _append_bounded(s.kernel_history.setdefault(name, []), ns)


def _engine(s: TraceState, ev: Event) -> None:
    if ev.kind == BEGIN:
        s.startup_current = {"stage": ev.name, "ts_ns": ev.ts_ns, **_attrs(ev)}
    elif ev.kind == COUNTER:  # progress within the stage in progress (weights read)
        if s.startup_current is not None:
            a = _attrs(ev)
            s.startup_current = {**s.startup_current, "progress": (a.get("bytes", 0), a.get("total_bytes", 0))}
    elif ev.kind == END:
        s.startup_current = None
        _startup_stage(s, ev)


def _cli(s: TraceState, ev: Event) -> None:
    """`serve`'s own startup stages (args, config, HTTP ready) join the engine's; `serve`
    itself is a span for the server's whole life, not a stage."""
    if ev.name != "serve":
        _engine(s, ev)
    elif ev.kind == BEGIN and s.phase == "startup":
        s.phase = "idle"  # the server is up: waiting for requests


HISTORY = 120  # steps of KV use and kernel time kept for sparklines


def _append_bounded(values: list, value) -> None:
    values.append(value)
    if len(values) > HISTORY:
        del values[:len(values) - HISTORY]


# ---- scheduler ----------------------------------------------------------------------------
def _scheduled(s: TraceState, ev: Event) -> None:
    rid, req = ev.request_id, s.request(ev.request_id)
    req.status, req.waiting_reason, req.preempt_reason = "RUNNING", None, None
    req.timeline.append({"event": SCHEDULED, "step": ev.step, "ts_ns": ev.ts_ns})
    if rid in s.waiting:
        s.waiting.remove(rid)
    if rid not in s.running:
        s.running.append(rid)


def _preempted(s: TraceState, ev: Event) -> None:
    rid, req = ev.request_id, s.request(ev.request_id)
    req.status, req.preempt_reason = PREEMPTED, _attrs(ev).get("reason")
    req.num_computed_tokens, req.block_table = 0, []
    req.num_preemptions += 1
    req.timeline.append({"event": PREEMPTED, "step": ev.step, "ts_ns": ev.ts_ns, "reason": req.preempt_reason})
    if rid in s.running:
        s.running.remove(rid)
    if rid not in s.waiting:
        s.waiting.insert(0, rid)


def _snapshot(s: TraceState, ev: Event) -> None:
    """The engine's own queues at schedule time replace the folded ones."""
    snap = _attrs(ev)
    s.snapshot, s.snapshot_step = snap, ev.step
    s.stats = snap.get("stats", s.stats)
    for queue_name in ("waiting", "running"):
        ids = []
        for r in snap.get(queue_name, []):
            req = s.request(r["request_id"])
            req.status = r["status"]
            req.num_computed_tokens, req.num_tokens = r["num_computed_tokens"], r["num_tokens"]
            req.num_prompt_tokens, req.num_cached_tokens = r["num_prompt_tokens"], r["num_cached_tokens"]
            req.num_preemptions, req.block_table = r["num_preemptions"], list(r["block_table"])
            ids.append(r["request_id"])
        setattr(s, queue_name, ids)
    reasons = snap.get("waiting_reasons", {})
    for rid in s.waiting:
        s.requests[rid].waiting_reason = reasons.get(rid)
    held = {b for rid in s.running for b in s.requests[rid].block_table}
    s.cached_free -= held  # a prefix-cache hit took a cached block back
    for sch in snap.get("scheduled", []):
        _scheduled_chunk(s.request(sch["request_id"]), sch, ev)


def _scheduled_chunk(req: RequestView, sch: dict, ev: Event) -> None:
    last = req.timeline[-1] if req.timeline else None
    if sch["kind"] == "decode" and last is not None and last["event"] == "decode" and last["last_step"] == ev.step - 1:
        last["steps"] += 1
        last["last_step"] = ev.step
    elif sch["kind"] == "decode":
        req.timeline.append({"event": "decode", "step": ev.step, "ts_ns": ev.ts_ns, "steps": 1, "last_step": ev.step})
    else:
        entry = {"event": "prefill", "step": ev.step, "ts_ns": ev.ts_ns, "tokens": sch["num_tokens"],
                 "from_token": sch["num_computed_before"]}
        if last is not None and last["event"] == SCHEDULED:  # its first chunk: the tokens before it were not computed
            entry["hit"] = req.prefix_hit_tokens  # ... but found in the prefix cache, or delivered by a KV connector
        req.timeline.append(entry)


def prompt_sources(r: RequestView) -> dict | None:
    """Where its prompt's KV came from at its first admission: {"hit": tokens found in the local prefix cache,
    "delivered": tokens a KV connector delivered (loaded or received), "computed": tokens its prefill computed,
    "step": the step of its first prefill chunk}; None before its first prefill."""
    for e in r.timeline:
        if e["event"] == "prefill" and "hit" in e:
            hit = min(e["hit"], e["from_token"])
            return {"hit": hit, "delivered": e["from_token"] - hit,
                    "computed": max(0, r.num_prompt_tokens - e["from_token"]), "step": e["step"]}
    return None


def kv_connector(s: TraceState) -> str | None:
    """The engine's KV connector (its kv_transfer_config's; --kv-offloading-size: OffloadingConnector), or None."""
    return ((s.engine_config or {}).get("kv_transfer_config") or {}).get("kv_connector")


def offload_tier(s: TraceState) -> dict | None:
    """The host-memory tier's counters (--kv-offloading-size: the OffloadingConnector's, in the engine's stats)."""
    return (s.stats.get("kv_connector_stats") or {}).get("OffloadingConnector")


def _schedule_span(s: TraceState, ev: Event) -> None:
    if ev.kind != SNAPSHOT:
        _span(s, ev, "core", 0)
    if ev.kind == SNAPSHOT:
        _snapshot(s, ev)
        if any(f[0] == ev.step for f in s.in_flight):
            _pending(s, ev, _attrs(ev))
    elif ev.kind == BEGIN:
        # a new schedule: the last one's table and model inputs are not this one's (a lesson may
        # schedule by hand twice in a step: the Step panel showed one schedule beside the other's inputs)
        s.phase, s.snapshot_step, s.batch = "schedule", None, None


# ---- block manager, model runner, kernels, sampler, detokenizer ---------------------------
def _block_manager(s: TraceState, ev: Event) -> None:
    a = _attrs(ev)
    if ev.request_id is None:
        return
    req = s.request(ev.request_id)
    if ev.name in (ALLOCATE, FREE_WINDOW):  # (a sliding window's passed blocks: the null block in their place)
        req.block_table = list(a.get("block_table", req.block_table))
        req.kv_block_tables = [list(t) for t in a.get("kv_block_tables", req.kv_block_tables)]
        s.cached_free.difference_update(req.block_table)  # new blocks, and prefix hits taken back
        for table in req.kv_block_tables[1:]:
            s.cached_free.difference_update(table)
    elif ev.name == FREE:
        _freed(s, req, a.get("block_ids", ()))
        req.block_table, req.kv_block_tables = [], []
    elif ev.name == CACHE_HIT:
        req.num_cached_tokens = req.prefix_hit_tokens = a.get("hit_tokens", 0)
        req.cache_hit_blocks = list(a.get("block_ids", ()))  # found; taken only if it is admitted
    elif ev.name == CACHE_MISS:
        req.prefix_hit_tokens = 0


def _kv_transfer(s: TraceState, ev: Event) -> None:
    a = _attrs(ev)
    if ev.request_id is not None:
        s.request(ev.request_id).kv_transfers.append(
            {"kind": ev.name, "step": ev.step, "ts_ns": ev.ts_ns, "block_ids": list(a.get("block_ids", ())),
             "bytes": a.get("bytes", 0), "seconds": a.get("seconds", 0.0), "connector": a.get("connector")})


def _evict(s: TraceState, ev: Event) -> None:
    s.cached_free.difference_update(_attrs(ev).get("block_ids", ()))


def _freed(s: TraceState, req: RequestView, freed) -> None:
    """Which freed blocks keep their cached contents. The KV-cache manager hashes a block once
    its KV is fully written: after postprocess (a finish), every token the trace knew before
    this step's (its NEW_TOKENS follow the FREE: the front end detokenizes after the core
    finished the step); before a step (a preemption or an abort), the computed tokens."""
    cfg = (s.engine_config or {}).get("cache", {})
    if not cfg.get("enable_prefix_caching", True) or not cfg.get("block_size"):
        return
    written = req.num_tokens if s.phase == "postprocess" else req.num_computed_tokens
    hashed = {b for table in [req.block_table, *req.kv_block_tables[1:]] for i, b in enumerate(table)
              if (i + 1) * cfg["block_size"] <= written}
    hashed.update(req.cache_hit_blocks)  # hits are cached blocks by definition
    s.cached_free.update(b for b in freed if b in hashed)


def _batch(s: TraceState, ev: Event) -> None:
    _in_flight(s, ev.step, "executing")
    if _older(s, ev.step):
        return  # async scheduling: the inputs of the step before the one shown
    s.batch, s.phase = _attrs(ev), "execute"
    for rid, slot in zip(s.batch.get("request_ids", ()), s.batch.get("slots", ())):
        s.request(rid).worker_slot = slot


def _kernel(s: TraceState, ev: Event) -> None:
    if ev.step is None:
        return  # the startup warm-up's launches belong to no step
    if _older(s, ev.step):  # async scheduling: the forward pass of the step before the one shown
        if ev.kind != BEGIN:
            s.older_kernels.append({"name": ev.name, **_attrs(ev)})
        _in_flight(s, ev.step, "executing")
        return
    if ev.kind != BEGIN:  # a launch is one instant, or a begin/end pair counted once, at its end
        s.kernels.append({"name": ev.name, **_attrs(ev)})
    s.phase = "execute"
    _in_flight(s, ev.step, "executing")


def rank_of(launch: dict) -> int:
    """The tensor-parallel rank that made a launch (an old trace's launches: rank 0)."""
    return launch.get("rank") or 0


def step_ranks(s: TraceState) -> list[int]:
    """The ranks with launches in this step, in order."""
    return sorted({rank_of(k) for k in s.kernels})


def worker(s: TraceState, rank: int) -> dict:
    """Rank `rank`'s worker record (made on first use)."""
    while len(s.workers) <= rank:
        s.workers.append({"rank": len(s.workers)})
    return s.workers[rank]


def hybrid_cache(s: TraceState) -> dict:
    """A hybrid model's KV-cache groups (layers, sliding window) and how many requests of max_model_len
    tokens fit, against full attention everywhere: the engine's kv_cache_alloc says it ({} for one group)."""
    for st in reversed(s.startup):
        if st["stage"] == "kv_cache_alloc" and st.get("kv_cache_groups"):
            return {k: st.get(k) for k in ("kv_cache_groups", "blocks_per_request", "requests_at_max_len",
                                          "requests_at_max_len_full_attention")}
    return {}


def kv_shards(s: TraceState) -> list[dict]:
    """Each rank's share of the KV cache, [{"rank", "heads": [a, b), "bytes", "bytes_per_block"}]:
    the engine's kv_cache_alloc says it for all ranks; failing that (a trace cut short), the
    workers' own. Empty with one rank."""
    for st in reversed(s.startup):
        if st["stage"] == "kv_cache_alloc" and st.get("ranks"):
            return list(st["ranks"])
    return [{"rank": w["rank"], **{k: w["kv_cache_alloc"].get(k) for k in ("heads", "kv_heads", "bytes",
                                                                             "bytes_per_block")}}
            for w in s.workers if "kv_cache_alloc" in w]


def _worker(s: TraceState, ev: Event) -> None:
    """A tensor-parallel worker's own events: its startup stages (per rank, beside the
    engine's, which stay in `startup`), ready, and the scheduler output it got each step."""
    a = _attrs(ev)
    if "rank" not in a:
        return
    rank = a["rank"]
    if a.get("world_size"):
        s.tensor_parallel_size = max(s.tensor_parallel_size, a["world_size"])
    w = worker(s, rank)
    if ev.name == EXECUTE_MODEL:
        w[EXECUTE_MODEL] = {"step": ev.step, **a}
    elif ev.name == WORKER_READY:
        w[WORKER_READY] = True
    elif ev.kind == BEGIN:
        w["current"] = ev.name
    elif ev.kind == END:
        w[ev.name] = dict(a)
        w["current"] = None


def _sampled(s: TraceState, ev: Event) -> None:
    a = _attrs(ev)
    if a.get("rank"):  # every tensor-parallel rank samples the same tokens: the view follows rank 0
        return
    _in_flight(s, ev.step, "sampled")
    if _older(s, ev.step):
        return  # async scheduling: the step before the one shown
    s.sampled, s.phase = a, "postprocess"


def _new_tokens(s: TraceState, ev: Event) -> None:
    a, req = _attrs(ev), s.request(ev.request_id)
    toks = a.get("token_ids", [])
    req.output_token_ids.extend(toks)
    req.num_output_tokens = max(req.num_output_tokens, len(req.output_token_ids))
    req.num_tokens += len(toks)
    req.text += a.get("text", "")
    if req.grammar is not None:
        req.grammar_pieces.append(a.get("text", ""))
    if a.get("text_after_stop") is not None:  # the API server cut the text at a stop string
        req.text = a["text_after_stop"]


# ---- the tracer itself --------------------------------------------------------------------
def _tracer(s: TraceState, ev: Event) -> None:
    if ev.name == PAUSED:
        s.paused_at = {k: v for k, v in _attrs(ev).items() if k not in ("gen", "pid")}  # where, not plumbing
    elif ev.name == RESUMED:
        s.paused_at = None
    elif ev.name == EVENTS_LOST:
        s.events_missed += _attrs(ev).get("count", 0)


# ---- structured outputs --------------------------------------------------------------------
def _grammar_compiled(s: TraceState, ev: Event) -> None:
    a, req = _attrs(ev), s.request(ev.request_id)
    req.grammar, req.grammar_compile_s = a.get("kind"), a.get("compile_s")


def _routing(s: TraceState, ev: Event) -> None:
    a = _attrs(ev)
    if ev.step != s.routing_step:
        s.routing, s.routing_step = {}, ev.step
    s.routing = {**s.routing, a.get("layer_idx"): a}


def _grammar_bitmask(s: TraceState, ev: Event) -> None:
    _span(s, ev, "core", _attrs(ev).get("fill_ns") or 0)
    s.grammar_mask = _attrs(ev) | {"step": ev.step}
    for rid, n in (s.grammar_mask.get("num_allowed") or {}).items():
        req = s.requests.get(rid)
        if req is not None:
            req.num_allowed.append(n)


def _drafts_validated(s: TraceState, ev: Event) -> None:
    s.drafts_cut.setdefault(ev.step, {})[ev.request_id] = _attrs(ev)


def _profiler(s: TraceState, ev: Event) -> None:
    if ev.name == PROFILE_START:
        s.profiling, s.profiler_dir = True, _attrs(ev).get("profiler_dir")
    elif ev.name == PROFILE_STOP:
        s.profiling = False


def _core_died(s: TraceState, ev: Event) -> None:
    s.engine_dead = _attrs(ev).get("reason") or "the engine core died"


_HANDLERS = {
    (IPC, CORE_DIED): _core_died,
    (ENGINE, CONFIG): _config,
    (TOKENIZER, ENCODE): _encoded,
    (ENGINE, QUEUED): _queued,
    (API, FAN_OUT): _fan_out,
    (SPEC_DECODE, VERIFIED): _verified,
    (ENGINE, FINISHED): _finished,
    (ENGINE, ABORTED): _finished,
    (ENGINE, STEP): _step,
    (ENGINE, BATCH_QUEUE): _batch_queue,
    (MODEL_RUNNER, EXECUTE_MODEL): lambda s, ev: _span(s, ev, "forward", 0),
    (SCHEDULER, UPDATE_FROM_OUTPUT): lambda s, ev: _span(s, ev, "core", 0),
    (SCHEDULER, SCHEDULED): _scheduled,
    (SCHEDULER, PREEMPTED): _preempted,
    (SCHEDULER, SCHEDULE): _schedule_span,
    (BLOCK_MANAGER, EVICT): _evict,
    (MODEL_RUNNER, BATCH): _batch,
    (MODEL_RUNNER, ROUTING): _routing,
    (SAMPLER, SAMPLED): _sampled,
    (DETOKENIZER, NEW_TOKENS): _new_tokens,
    (STRUCTURED_OUTPUT, GRAMMAR_COMPILED): _grammar_compiled,
    (STRUCTURED_OUTPUT, BITMASK): _grammar_bitmask,
    (STRUCTURED_OUTPUT, DRAFTS_VALIDATED): _drafts_validated,
    (PROFILER, PROFILE_START): _profiler,
    (PROFILER, PROFILE_STOP): _profiler,
}
_LAYER_HANDLERS = {
    HTTP: _http,
    ENGINE: _engine,
    CLI: _cli,
    BLOCK_MANAGER: _block_manager,
    KERNEL: _kernel,
    TRACER: _tracer,
    WORKER: _worker,
    KV_TRANSFER: _kv_transfer,
}


def snapshot_view(state: TraceState) -> dict:
    """The schedule snapshot as it would be recorded, rebuilt from the folded state (for
    checking the fold against the engine, and for viewers that want the snapshot's shape)."""
    def req_state(rid: str) -> dict:
        r = state.requests[rid]
        return dict(request_id=rid, status=r.status, num_computed_tokens=r.num_computed_tokens,
                    num_tokens=r.num_tokens, num_prompt_tokens=r.num_prompt_tokens,
                    num_output_tokens=len(r.output_token_ids), block_table=list(r.block_table),
                    num_cached_tokens=r.num_cached_tokens, num_preemptions=r.num_preemptions,
                    priority=r.priority)
    return dict(waiting=[req_state(r) for r in state.waiting], running=[req_state(r) for r in state.running])


class LiveState:
    """The state, kept current from the bus by a reader that folds what it pulls.

    ``update()`` folds everything published since the last call (a TUI calls it on its
    refresh timer; ``/trace/state`` before answering). ``view()`` returns a copy that is safe
    to read while the engine keeps running.
    """

    def __init__(self, bus: EventBus, from_start: bool = True, max_finished: int | None = MAX_FINISHED):
        self._sub = bus.subscribe(from_start=from_start)
        self._lock = threading.Lock()
        self.state = TraceState(max_finished=max_finished)
        self._follower: threading.Thread | None = None
        self._follower_stop = threading.Event()

    @property
    def max_finished(self) -> int | None:
        return self.state.max_finished

    @max_finished.setter
    def max_finished(self, n: int | None) -> None:
        if n is not None and n < 1:
            raise ValueError(f"max_finished must be >= 1 (or None: keep all), got {n}")
        with self._lock:
            self.state.max_finished = n
            trim_finished(self.state)

    def follow(self, interval: float = FOLLOW_INTERVAL) -> None:
        """Fold in a daemon thread every `interval` s, so a reader never meets a backlog
        (``serve`` does this: 2,000 requests unread took ~5 s to fold at the first
        /trace/state; a TUI already updates ten times a second). ``stop_following`` ends it."""
        if self._follower is None:
            self._follower_stop.clear()
            self._follower = threading.Thread(target=self._follow, args=(interval,), name="trace-state", daemon=True)
            self._follower.start()

    def stop_following(self) -> None:
        self._follower_stop.set()
        if self._follower is not None:
            self._follower.join()
            self._follower = None

    def _follow(self, interval: float) -> None:
        while not self._follower_stop.wait(interval):
            self.update()

    @property
    def following(self) -> bool:
        return self._follower is not None

    def update(self, max_events: int | None = None) -> int:
        """Fold the pending events; returns how many."""
        return len(self.update_events(max_events)[0])

    def update_events(self, max_events: int | None = None) -> tuple[list[Event], int]:
        """Fold the pending events; returns them, and how many before them were lost (what a
        TUI's log panel shows, so the TUI folds this state instead of decoding every event again)."""
        with self._lock:
            pulled = self._sub.pull(max_events)
            self.state.events_missed += pulled.missed
            for ev in pulled.events:
                fold(self.state, ev)
            return pulled.events, pulled.missed

    def view(self) -> TraceState:
        self.update()
        with self._lock:
            return self.state.clone()
