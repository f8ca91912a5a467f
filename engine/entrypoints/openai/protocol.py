"""OpenAI-compatible request and response bodies (the subset this engine serves).

Requests ignore unknown fields (clients send extras such as `logit_bias` or `tools`) but
reject what Python's JSON parser lets through and nothing after it could handle: non-finite
numbers (a NaN temperature would reach the sampler), integers past 64 bits (``Int``: no
engine limit is that large, and the trace encoder could not write them) and strings with a
lone UTF-16 surrogate such as ``"\\ud800"`` (``Text``: not Unicode text, so no tokenizer
takes it). Each is a 400 naming the field, as in vLLM.
"""
from __future__ import annotations

import time
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_serializer

# torch.Generator.manual_seed accepts exactly this range
SEED_MIN, SEED_MAX = -(2 ** 63), 2 ** 64 - 1
MAX_LOGPROBS = 20  # the engine's limit
INT64_MIN, INT64_MAX = -(2 ** 63), 2 ** 63 - 1


def _unicode(s: str) -> str:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"not valid Unicode text: a lone surrogate {s[e.start]!a} at character {e.start}") from None
    return s


Int = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
Text = Annotated[str, AfterValidator(_unicode)]


class RequestModel(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(RequestModel):
    include_usage: bool = False


class JsonSchemaFormat(RequestModel):
    name: Text = "response"
    description: Text | None = None
    schema_: dict | None = Field(None, alias="schema", description="the JSON schema the answer must follow")
    strict: bool | None = None


class ResponseFormat(RequestModel):
    """OpenAI's response_format: text (no constraint), json_object (any JSON object) or json_schema."""
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(RequestModel):
    """vLLM's structured_outputs: exactly one of json (a schema), json_object, regex, choice or grammar (EBNF)."""
    json_: dict | Text | None = Field(None, alias="json")
    regex: Text | None = None
    choice: list[Text] | None = None
    grammar: Text | None = None
    json_object: bool | None = None
    whitespace_pattern: Text | None = None
    disable_any_whitespace: bool = False


class SamplingRequest(RequestModel):
    """Fields shared by completions and chat completions."""
    model: Text | None = Field(None, description="served model name; omitted means the served model")
    temperature: float | None = Field(None, description="0 = greedy; default 1")
    top_p: float | None = None
    top_k: Int | None = Field(None, description="0 or -1 = off (vLLM extension)")
    min_p: float | None = None
    n: Int = Field(1, description="choices per prompt: n child requests that share the prompt's KV blocks")
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: Text | list[Text] | None = None
    stop_token_ids: list[Int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: Int = 0
    ignore_eos: bool = False
    priority: Int = Field(0, description="with --scheduling-policy priority: lower is scheduled first (vLLM)")
    logit_bias: dict[str, float] | None = Field(None, description="token id -> bias in [-100, 100] (OpenAI)")
    allowed_token_ids: list[Int] | None = Field(None, description="only these tokens may be generated (vLLM)")
    bad_words: list[Text] | None = Field(None, description="words never generated (vLLM)")
    response_format: ResponseFormat | None = Field(None, description="json_object or json_schema (OpenAI)")
    structured_outputs: StructuredOutputs | None = Field(None, description="json, regex, choice or grammar (vLLM)")
    kv_transfer_params: dict | None = Field(None, description="for the KV connector: disaggregated prefill (vLLM)")
    user: Text | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None


class CompletionRequest(SamplingRequest):
    prompt: Text | list[Text] | list[Int] | list[list[Int]]
    max_tokens: Int | None = 16
    logprobs: Int | None = Field(None, description=f"top logprobs per token, 0..{MAX_LOGPROBS}")
    best_of: Int | None = Field(None, description="refused, as in vLLM V1: use n")
    echo: bool = False


class TextPart(RequestModel):
    type: Literal["text"]
    text: Text


class ChatMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None
    name: Text | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int | None = Field(None, description="deprecated by OpenAI; max_completion_tokens wins")
    max_completion_tokens: Int | None = None
    logprobs: bool = False
    top_logprobs: Int | None = None
    add_generation_prompt: bool = True


class TokenizeRequest(RequestModel):
    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True


class DetokenizeRequest(RequestModel):
    model: Text | None = None
    tokens: list[Int]


# ---- responses --------------------------------------------------------------------------
class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = []
    token_logprobs: list[float | None] = []
    tokens: list[str] = []
    top_logprobs: list[dict[str, float] | None] = []


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    kv_transfer_params: dict | None = None  # the prefill instance's, for the decode instance (vLLM)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    kv_transfer_params: dict | None = None  # the prefill instance's, for the decode instance (vLLM)


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None

    @field_serializer("delta")
    def _delta(self, delta: DeltaMessage) -> dict:
        return delta.model_dump(exclude_none=True)  # a delta carries only what changed


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "vllm-trace"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
