"""What the engine returns, with vLLM's names."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = most likely
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None  # "stop", "length", "abort"
    stop_reason: int | str | None = None  # the stop string or stop token that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)  # arrival / first token / finish times (monotonic s)
    # with SamplingParams.prompt_logprobs: None for the first prompt token, then per token id -> Logprob
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    kv_transfer_params: dict | None = None  # a KV connector's, on the finished output (disaggregated prefill)


@dataclass
class EngineStats:
    step: int  # steps run so far
    num_waiting: int
    num_running: int
    num_free_blocks: int
    num_total_blocks: int  # blocks requests can hold: the null block (block 0) is not counted
    num_preemptions: int
    prefix_cache_queries: int  # tokens looked up in the prefix cache
    prefix_cache_hits: int  # tokens found there
    kv_cache_usage: float  # fraction of blocks held by requests
    # speculative decoding (vLLM V1's vllm:spec_decode_* counters), since the engine started
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    # a mixture of experts, since the engine started: per MoE decoder layer (its index, as a string: plain JSON
    # in every snapshot), the tokens each expert received; and the expert-parallel ranks the experts are split
    # over (rank r holds experts [r·E/N, (r+1)·E/N))
    moe_expert_tokens: dict[str, list[int]] = field(default_factory=dict)
    moe_ep_size: int = 1
    # a KV connector (vLLM V1's vllm:external_prefix_cache_*): tokens of admitted requests it was asked
    # about, and tokens it delivered
    connector_prefix_cache_queries: int = 0
    connector_prefix_cache_hits: int = 0
    # per KV-cache group (one for a dense model; a hybrid one's sliding-window and full-attention groups):
    # {"kind": "full_attention" | "sliding_window", "sliding_window", "layers", "num_blocks": blocks held now}
    kv_cache_groups: list[dict] = field(default_factory=list)
    # the connector's own counters (V1's SchedulerStats.kv_connector_stats), by connector: a host-memory tier's
    # size, blocks held, blocks stored, tokens hit and blocks loaded back; None without them
    kv_connector_stats: dict | None = None


# ---- worker -> engine core (vLLM V1's ``v1/outputs.py``) -----------------------------------------
@dataclass
class ModelRunnerOutput:
    """One step's result, from the worker (output_rank's) to the scheduler (V1's fields)."""
    req_ids: list[str]  # in batch order
    req_id_to_index: dict[str, int]
    # per request: the tokens it gained (one; with drafts the accepted ones then one more); empty for a
    # chunk that does not end its prefill
    sampled_token_ids: list[list[int]]
    # per request that asked for logprobs, else None: per sampled token ([token id, logprob], ...), its rank
    logprobs: list[list[tuple[dict[int, float], int]] | None] | None = None
    # request id -> (first position, [[[prompt token at position + 1, logprob, rank], [top id, logprob, rank],
    # ...], ...]) for requests that asked for prompt logprobs and computed prompt tokens this step
    prompt_logprobs_dict: dict[str, tuple[int, list]] = field(default_factory=dict)
    # a mixture of experts (ours: vLLM's EPLB counts the same in its worker): per MoE decoder layer, the
    # tokens each expert received this step
    expert_load: dict[int, list[int]] | None = None
    kv_connector_output: KVConnectorOutput | None = None  # a KV connector's transfers that finished


@dataclass
class KVConnectorOutput:
    """What a worker's KV connector reports after a step (V1's fields)."""
    finished_sending: set[str] | None = None  # requests whose blocks were sent: free them now
    finished_recving: set[str] | None = None  # requests whose blocks arrived: schedule them now
    invalid_block_ids: set[int] | None = None  # blocks whose load failed: their tokens are computed instead

    def is_empty(self) -> bool:
        return not (self.finished_sending or self.finished_recving)


@dataclass
class DraftTokenIds:
    """Drafts for the next step (V1's name), from the worker's proposer (take_draft_token_ids)."""
    req_ids: list[str]
    draft_token_ids: list[list[int]]
