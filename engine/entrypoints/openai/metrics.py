"""Prometheus metrics with vLLM V1's names, labelled as vLLM labels them: ``model_name`` and ``engine``
(the engine core's index, "0": one core per server here).

Counters and histograms are fed from the engine thread after every step (a step listener on
the EngineClient), with vLLM V1's accounting: a request's prompt tokens count in the step
that produced its first token. Gauges are read from the engine's latest published stats at
scrape time, so a request queued while the engine is paused shows in
``vllm:num_requests_waiting`` at once. Each app has its own registry (tests build several).

Three counters are ours, not vLLM's, and named so. ``vllm_trace:request_abort_total``: the requests
aborted (a client that went away, an explicit abort). vLLM counts no such thing: its
``OutputProcessor.abort_requests`` (``vllm/v1/engine/output_processor.py``) drops an aborted
request's state without recording its stats, so ``vllm:request_success_total`` does not move
for it; neither does ours. For a mixture of experts, ``vllm_trace:moe_expert_tokens_total``
(labels ``layer``, ``expert``): the tokens routed to each expert of each MoE decoder layer, and
``vllm_trace:moe_ep_rank_tokens_total`` (label ``rank``): under expert parallelism, those computed
by each rank's experts, all layers together. vLLM exports no expert load (its EPLB keeps the
counts inside the workers).

Per KV-cache group (labels ``group``, ``kind`` = full_attention or sliding_window, ``window``: the
window in tokens, empty for full attention), two gauges of ours: ``vllm_trace:kv_cache_group_blocks``,
the blocks the group's block tables hold now, and ``vllm_trace:kv_cache_group_usage_perc``, those as
a fraction of the pool's usable blocks (the groups share one pool: the fractions add up to
``vllm:kv_cache_usage_perc``, less the prefix cache's free blocks). A dense model has one group; a
hybrid one (Gemma 3, gpt-oss) shows its sliding-window groups holding a window's blocks per request
while the full-attention group grows. vLLM exports only the pool's usage.
"""
from __future__ import annotations

import time

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from engine.engine.protocol import EngineClient
from engine.outputs import EngineStats, RequestOutput

# vLLM V1's buckets
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0]
LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0]
ENGINE_INDEX = "0"  # vLLM's `engine` label: the engine core's index (data parallelism has several)
ITERATION_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]


class ServerMetrics:
    def __init__(self, engine: EngineClient, model_name: str):
        prometheus_client.disable_created_metrics()  # as vLLM: no `_created` series beside each counter
        self.engine = engine
        self.registry = r = CollectorRegistry()
        m = ["model_name", "engine"]
        ids = (model_name, ENGINE_INDEX)

        def counter(name, doc, labels=m):
            return Counter(name, doc, labels, registry=r)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, m, buckets=buckets, registry=r).labels(*ids)

        self._running = Gauge("vllm:num_requests_running", "Requests in the running queue.", m, registry=r).labels(*ids)
        self._waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", m,
                              registry=r).labels(*ids)
        self._kv_usage = Gauge(
            "vllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = 100%).", m, registry=r
        ).labels(*ids)
        self.prefix_queries = counter("vllm:prefix_cache_queries", "Prefix-cache queries, in tokens.").labels(*ids)
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prefix-cache hits, in tokens.").labels(*ids)
        self.external_queries = counter("vllm:external_prefix_cache_queries", "Tokens a KV connector was asked "
                                        "about (other instances' caches).").labels(*ids)
        self.external_hits = counter("vllm:external_prefix_cache_hits", "Tokens a KV connector delivered "
                                     "(computed by another instance).").labels(*ids)
        by_source = counter("vllm:prompt_tokens_by_source", "Prompt tokens by source: computed here "
                            "(local_compute), found in the prefix cache (local_cache_hit) or delivered by a KV "
                            "connector (external_kv_transfer).", [*m, "source"])
        self.prompt_by_source = {s: by_source.labels(*ids, s)
                                 for s in ("local_compute", "local_cache_hit", "external_kv_transfer")}
        self.preemptions = counter("vllm:num_preemptions", "Preemptions.").labels(*ids)
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prefill tokens processed.").labels(*ids)
        self.generation_tokens = counter("vllm:generation_tokens", "Generated tokens.").labels(*ids)
        self.request_success = counter("vllm:request_success", "Finished requests, by finish reason.",
                                       m + ["finished_reason"])
        self.request_abort = counter("vllm_trace:request_abort",
                                     "Aborted requests (ours: vLLM does not count them).").labels(*ids)
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Time between tokens.", ITL_BUCKETS)
        self.tpot = histogram("vllm:request_time_per_output_token_seconds",
                              "Per request: first to last token, divided by the tokens after the first.", ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Arrival to finish.", LATENCY_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds", "Arrival to first scheduled.", LATENCY_BUCKETS)
        self.spec_drafts = counter("vllm:spec_decode_num_drafts", "Speculative drafts verified.").labels(*ids)
        self.spec_draft_tokens = counter("vllm:spec_decode_num_draft_tokens",
                                         "Speculative draft tokens verified.").labels(*ids)
        self.spec_accepted = counter("vllm:spec_decode_num_accepted_tokens",
                                     "Speculative draft tokens accepted.").labels(*ids)
        self.spec_accepted_per_pos = counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                             "Accepted draft tokens, by position in the draft.", [*m, "position"])
        self.expert_tokens = counter("vllm_trace:moe_expert_tokens",
                                     "Tokens routed to each expert, per MoE decoder layer (ours).",
                                     [*m, "layer", "expert"])
        self.rank_tokens = counter("vllm_trace:moe_ep_rank_tokens",
                                   "Tokens computed by each expert-parallel rank's experts, all MoE layers (ours).",
                                   [*m, "rank"])
        self.iteration_tokens = histogram("vllm:iteration_tokens_total", "Tokens per engine step.", ITERATION_BUCKETS)
        group = [*m, "group", "kind", "window"]
        self._group_blocks = Gauge("vllm_trace:kv_cache_group_blocks", "KV-cache blocks each KV-cache group's block "
                                   "tables hold now (ours).", group, registry=r)
        self._group_usage = Gauge("vllm_trace:kv_cache_group_usage_perc", "Each KV-cache group's blocks, as a "
                                  "fraction of the pool's usable blocks (ours; 1 = 100%).", group, registry=r)
        self.model_name = model_name
        self._seen: dict[str, tuple[int, float]] = {}  # request id -> (tokens so far, last token time)
        self._last = engine.stats
        engine.step_listeners.append(self.on_step)

    def _by_source(self, out: RequestOutput) -> None:
        cached = min(out.num_cached_tokens, len(out.prompt_token_ids))
        external = min(out.metrics.get("num_external_computed_tokens", 0), cached)
        self.prompt_by_source["local_compute"].inc(len(out.prompt_token_ids) - cached)
        self.prompt_by_source["local_cache_hit"].inc(cached - external)
        self.prompt_by_source["external_kv_transfer"].inc(external)

    def on_step(self, outputs: list[RequestOutput], stats: EngineStats, aborted: list[str]) -> None:
        """Engine thread, after each step."""
        now, step_tokens = time.monotonic(), 0
        for out in outputs:
            m, n = out.metrics, sum(len(c.token_ids) for c in out.outputs)
            before, last_time = self._seen.get(out.request_id, (0, None))
            new = n - before
            if new > 0:
                step_tokens += new
                self.generation_tokens.inc(new)
                if before == 0:  # first token: its prompt was processed in this step
                    step_tokens += len(out.prompt_token_ids)
                    self.prompt_tokens.inc(len(out.prompt_token_ids))
                    self._by_source(out)
                    self.ttft.observe(m["first_token_time"] - m["arrival_time"])
                    self.queue_time.observe(m["first_scheduled_time"] - m["arrival_time"])
                else:
                    self.itl.observe((now - last_time) / new)
            if out.finished:
                self._seen.pop(out.request_id, None)
                self.request_success.labels(self.model_name, ENGINE_INDEX, out.outputs[0].finish_reason).inc()
                self.e2e.observe(now - m["arrival_time"])
                # as vLLM's IterationStats.update_from_finished_request: 0 for a one-token answer
                first = m["first_token_time"]
                self.tpot.observe((now - first) / (n - 1) if n > 1 and first is not None else 0.0)
            else:
                self._seen[out.request_id] = (n, now)
        for rid in aborted:
            self._seen.pop(rid, None)
            self.request_abort.inc()
        if outputs:
            self.iteration_tokens.observe(step_tokens)
        last, self._last = self._last, stats
        self.prefix_queries.inc(max(0, stats.prefix_cache_queries - last.prefix_cache_queries))
        self.prefix_hits.inc(max(0, stats.prefix_cache_hits - last.prefix_cache_hits))
        self.preemptions.inc(max(0, stats.num_preemptions - last.num_preemptions))
        self.external_queries.inc(max(0, stats.connector_prefix_cache_queries - last.connector_prefix_cache_queries))
        self.external_hits.inc(max(0, stats.connector_prefix_cache_hits - last.connector_prefix_cache_hits))
        if stats.spec_num_drafts != last.spec_num_drafts:
            self._spec(stats, last)
        if stats.moe_expert_tokens != last.moe_expert_tokens:
            self._expert_load(stats, last)

    def _spec(self, stats: EngineStats, last: EngineStats) -> None:
        self.spec_drafts.inc(stats.spec_num_drafts - last.spec_num_drafts)
        self.spec_draft_tokens.inc(stats.spec_num_draft_tokens - last.spec_num_draft_tokens)
        self.spec_accepted.inc(stats.spec_num_accepted_tokens - last.spec_num_accepted_tokens)
        before = last.spec_num_accepted_tokens_per_pos
        for pos, n in enumerate(stats.spec_num_accepted_tokens_per_pos):
            gained = n - (before[pos] if pos < len(before) else 0)
            self.spec_accepted_per_pos.labels(self.model_name, ENGINE_INDEX, str(pos)).inc(gained)

    def _expert_load(self, stats: EngineStats, last: EngineStats) -> None:
        ranks = stats.moe_ep_size
        for layer_idx, counts in stats.moe_expert_tokens.items():
            before = last.moe_expert_tokens.get(layer_idx) or [0] * len(counts)
            per_rank = max(1, len(counts) // ranks)
            for e, (n, b) in enumerate(zip(counts, before)):
                if n > b:
                    self.expert_tokens.labels(self.model_name, ENGINE_INDEX, str(layer_idx), str(e)).inc(n - b)
                    self.rank_tokens.labels(self.model_name, ENGINE_INDEX, str(e // per_rank)).inc(n - b)

    def render(self) -> bytes:
        stats = self.engine.stats
        self._running.set(stats.num_running)
        self._waiting.set(stats.num_waiting)
        self._kv_usage.set(stats.kv_cache_usage)
        for i, g in enumerate(stats.kv_cache_groups):
            labels = (self.model_name, ENGINE_INDEX, str(i), g["kind"], str(g["sliding_window"] or ""))
            self._group_blocks.labels(*labels).set(g["num_blocks"])
            self._group_usage.labels(*labels).set(g["num_blocks"] / max(stats.num_total_blocks, 1))
        return generate_latest(self.registry)
