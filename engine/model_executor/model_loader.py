"""Find a checkpoint, read its config, load its weights by name.

A model name resolves, in order: the built-in ``tiny-gpt2`` (and ``tiny-gpt2-random``); a local
directory; the Hugging Face cache; the Hugging Face hub (download). Every checkpoint, the
built-in ones included, goes through the same checks and ``load_state_dict``. A checkpoint
directory holding a ``SHA256SUMS`` file (as the built-in one does) has every file listed there
verified before use, so a corrupted or truncated file is an error, not a silently wrong model.

``read_config`` picks the architecture from ``architectures`` in config.json, as vLLM's model
registry does (``models/registry.py``), and reads it into that family's config: ``GPT2Config``
(GPT-2's own field names) or ``LlamaConfig`` (Llama and Qwen3, Hugging Face's names). Both
answer the questions the engine asks of any model (``num_layers``, ``num_heads``,
``num_kv_heads``, ``head_size``, ``max_position_embeddings``), as vLLM's ``ModelConfig`` does.
Weights may be one safetensors file, several listed in ``model.safetensors.index.json`` (a
sharded checkpoint), or a ``pytorch_model.bin``; a bfloat16 checkpoint is read as it is stored
and cast where the model is built (float32 on the CPU; bfloat16 kept on CUDA, see ``default_dtype``).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from engine import builtin_model

if TYPE_CHECKING:  # torch is imported where weights are read: the API server resolves names without it
    import torch

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
SHARD_INDEX = "model.safetensors.index.json"  # a sharded checkpoint: tensor name -> shard file
TOKENIZER_FILES = ("tokenizer.json", "vocab.json")
CHECKSUM_FILE = "SHA256SUMS"
HUB_PATTERNS = ["config.json", "generation_config.json", "*.safetensors", SHARD_INDEX, "tokenizer*", "vocab.json",
                "merges.txt", "special_tokens_map.json"]


class ModelNotFoundError(ValueError):
    """The model name or path could not be resolved to a checkpoint."""


class UnsupportedCheckpointError(ValueError):
    """The directory exists but is not a checkpoint of an architecture the engine implements."""


class ChecksumMismatchError(ValueError):
    """A file of the checkpoint differs from its line in the checkpoint's SHA256SUMS."""


@dataclass
class GPT2Config:
    vocab_size: int
    n_positions: int
    n_embd: int
    n_layer: int
    n_head: int
    n_inner: int
    layer_norm_epsilon: float
    eos_token_id: int | None
    scale_attn_by_inverse_layer_idx: bool = False
    torch_dtype: str | None = None
    architecture = "GPT2LMHeadModel"

    @property
    def head_size(self) -> int:
        return self.n_embd // self.n_head

    # what the engine asks of every architecture (LlamaConfig has the same properties)
    num_layers = property(lambda self: self.n_layer)
    num_heads = property(lambda self: self.n_head)
    num_kv_heads = property(lambda self: self.n_head)  # multi-head attention: one KV head per query head
    hidden_size = property(lambda self: self.n_embd)
    intermediate_size = property(lambda self: self.n_inner)
    max_position_embeddings = property(lambda self: self.n_positions)


@dataclass
class LlamaConfig:
    """LlamaForCausalLM and Qwen3ForCausalLM (Hugging Face's field names). Qwen3 is Llama plus
    an RMSNorm over each head of q and of k before RoPE (``qk_norm``), with head_dim not
    necessarily hidden_size / num_attention_heads."""
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # None: plain RoPE; else {"rope_type": "llama3" | "linear", ...}
    attention_bias: bool
    mlp_bias: bool
    tie_word_embeddings: bool
    qk_norm: bool
    eos_token_id: int | None
    torch_dtype: str | None = None
    # mixtures of experts (Qwen3MoeForCausalLM, MixtralForCausalLM); 0 experts: a dense model
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # each expert's width (Mixtral: its intermediate_size)
    norm_topk_prob: bool = False  # renormalise the top-k routing weights to sum to 1
    decoder_sparse_step: int = 1  # Qwen3-MoE: layer i has experts if (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()  # ... and i is not listed here (a dense MLP there)
    sliding_window: int | None = None  # Mistral: every layer reads the last sliding_window positions only
    layer_types: list[str] | None = None  # "sliding_attention" / "full_attention" per layer (None: all sliding)
    query_pre_attn_scalar: float | None = None  # Gemma 3: attention scaled by its -1/2 power, not head_dim's
    rope_local_theta: float | None = None  # Gemma 3: the sliding-window layers' RoPE base
    swiglu_alpha: float = 1.702  # gpt-oss: its experts' clamped SwiGLU, (up + 1) · gate · sigmoid(alpha · gate) ...
    swiglu_limit: float = 7.0  # ... with the gate clamped above at limit, up to [-limit, limit]

    num_layers = property(lambda self: self.num_hidden_layers)
    num_heads = property(lambda self: self.num_attention_heads)
    num_kv_heads = property(lambda self: self.num_key_value_heads)
    head_size = property(lambda self: self.head_dim)

    @property
    def layer_sliding_windows(self) -> list[int | None]:
        """Each layer's sliding window (None: full attention)."""
        if not self.sliding_window:
            return [None] * self.num_hidden_layers
        types = self.layer_types or ["sliding_attention"] * self.num_hidden_layers
        return [self.sliding_window if t == "sliding_attention" else None for t in types]


ModelArchConfig = GPT2Config | LlamaConfig

def resolve(model: str) -> Path:
    """Model name or path -> local checkpoint directory."""
    if model in builtin_model.NAMES:
        return builtin_model.builtin_path(model)
    path = Path(model).expanduser()
    if path.exists():
        if not path.is_dir():
            raise UnsupportedCheckpointError(f"model {model!r} is a file; give a checkpoint directory")
        return path
    if path.is_absolute() or model.startswith((".", "~")) or model.count("/") > 1:
        raise ModelNotFoundError(f"model path {model!r} does not exist. "
                                 f"Try the built-in offline model {builtin_model.NAME!r} "
                                 f"(e.g. vllm-trace serve {builtin_model.NAME})")
    return _from_hub(model)


def _from_hub(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    tried = [f"local directory ./{repo_id} (not found)"]
    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_PATTERNS, local_files_only=True))
    except Exception as e:  # any failure means "not cached"; we say so below
        tried.append(f"Hugging Face cache ({type(e).__name__})")
    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_PATTERNS))
    except Exception as e:  # any failure: we say which and why below
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        tried.append(f"Hugging Face hub download ({type(e).__name__}: {reason[:160]})")
    raise ModelNotFoundError(
        f"could not load model {repo_id!r}. Tried: " + "; ".join(tried)
        + f". If you are offline, use the built-in model: {builtin_model.NAME}")


def read_config(path: Path) -> ModelArchConfig:
    from engine.model_executor.models.registry import architecture_of

    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise UnsupportedCheckpointError(f"{path} is not a model checkpoint: it has no config.json")
    try:
        raw = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise UnsupportedCheckpointError(f"{cfg_file} is not valid JSON: {e}") from None
    arch = architecture_of(raw, path)
    try:
        if arch == "Gemma3ForCausalLM":
            return _gemma3_config(raw, path)
        if arch == "GptOssForCausalLM":
            return _gpt_oss_config(raw, path)
        return _gpt2_config(raw, path) if arch == "GPT2LMHeadModel" else _llama_config(raw, path, arch)
    except KeyError as e:
        raise UnsupportedCheckpointError(f"{cfg_file} ({arch}) has no {e.args[0]!r}") from None


def _gpt2_config(raw: dict, path: Path) -> GPT2Config:
    if raw.get("reorder_and_upcast_attn"):
        raise UnsupportedCheckpointError(f"{path}: reorder_and_upcast_attn=True is not supported")
    if raw.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
        raise UnsupportedCheckpointError(f"{path}: activation {raw['activation_function']!r} is not supported")
    if not raw.get("scale_attn_weights", True):
        raise UnsupportedCheckpointError(f"{path}: scale_attn_weights=False is not supported")
    n_embd = raw["n_embd"]
    return GPT2Config(
        vocab_size=raw["vocab_size"], n_positions=raw["n_positions"], n_embd=n_embd,
        n_layer=raw["n_layer"], n_head=raw["n_head"], n_inner=raw.get("n_inner") or 4 * n_embd,
        layer_norm_epsilon=raw.get("layer_norm_epsilon", 1e-5), eos_token_id=_eos(raw),
        scale_attn_by_inverse_layer_idx=bool(raw.get("scale_attn_by_inverse_layer_idx", False)),
        torch_dtype=_dtype(raw),
    )


ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # implemented in layers/rotary_embedding.py


# Llama's layers with config.sliding_window
SLIDING_WINDOW_ARCHS = ("MistralForCausalLM", "MinistralForCausalLM", "GptOssForCausalLM")


def _llama_config(raw: dict, path: Path, arch: str) -> LlamaConfig:
    if raw.get("hidden_act", "silu") != "silu":
        raise UnsupportedCheckpointError(f"{path}: hidden_act {raw['hidden_act']!r} is not supported (only silu)")
    if raw.get("use_sliding_window"):
        raise UnsupportedCheckpointError(f"{path}: use_sliding_window (Qwen's windowed layers) is not supported; "
                                         f"sliding windows run with MistralForCausalLM")
    window = raw.get("sliding_window") if arch in SLIDING_WINDOW_ARCHS else None
    layer_types = raw.get("layer_types") if window else None
    if layer_types is not None and arch == "MistralForCausalLM":
        raise UnsupportedCheckpointError(f"{path}: transformers' MistralForCausalLM ignores layer_types (a window on "
                                         f"every layer); name the architecture MinistralForCausalLM to mix them")
    if layer_types is not None and (len(layer_types) != raw["num_hidden_layers"]
                                    or set(layer_types) - {"sliding_attention", "full_attention"}):
        raise UnsupportedCheckpointError(f"{path}: layer_types must name sliding_attention or full_attention for "
                                         f"each of the {raw['num_hidden_layers']} layers")
    # transformers 5 writes rope_parameters {"rope_type", "rope_theta", ...}; 4.x wrote rope_theta
    # and rope_scaling {"type" or "rope_type", ...} (most hub checkpoints still do)
    rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(rope.pop("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = rope.pop("rope_type", rope.pop("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise UnsupportedCheckpointError(f"{path}: rope_scaling type {rope_type!r} is not implemented; "
                                         f"implemented: {', '.join(ROPE_TYPES)}")
    heads = raw["num_attention_heads"]
    moe = _moe_fields(raw, path, arch)
    return LlamaConfig(
        architecture=arch, vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"], num_hidden_layers=raw["num_hidden_layers"],
        num_attention_heads=heads, num_key_value_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
        max_position_embeddings=raw["max_position_embeddings"], rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=theta, rope_scaling=None if rope_type == "default" else {"rope_type": rope_type, **rope},
        attention_bias=bool(raw.get("attention_bias", False)), mlp_bias=bool(raw.get("mlp_bias", False)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"), eos_token_id=_eos(raw), torch_dtype=_dtype(raw),
        sliding_window=window, layer_types=layer_types, **moe,
    )


def _moe_fields(raw: dict, path: Path, arch: str) -> dict:
    """The expert fields of a Qwen3-MoE or Mixtral config.json; {} for a dense model. Hub
    Qwen3-MoE configs name the expert count num_experts, transformers 5 num_local_experts."""
    if arch == "MixtralForCausalLM":
        if raw.get("sliding_window"):
            raise UnsupportedCheckpointError(f"{path}: sliding-window attention is not supported")
        return dict(num_experts=raw["num_local_experts"], num_experts_per_tok=raw["num_experts_per_tok"],
                    moe_intermediate_size=raw["intermediate_size"], norm_topk_prob=True)
    if arch == "Qwen3MoeForCausalLM":
        return dict(num_experts=raw.get("num_experts") or raw["num_local_experts"],
                    num_experts_per_tok=raw["num_experts_per_tok"], moe_intermediate_size=raw["moe_intermediate_size"],
                    norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
                    decoder_sparse_step=raw.get("decoder_sparse_step") or 1,
                    mlp_only_layers=tuple(raw.get("mlp_only_layers") or ()))
    return {}


def _gemma3_config(raw: dict, path: Path) -> LlamaConfig:
    """Gemma3ForCausalLM (text): Llama's fields, plus each layer's type, the window, the scalar its
    attention scales by and the local layers' RoPE base; what it does not implement is refused."""
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if raw.get(key) is not None:
            raise UnsupportedCheckpointError(f"{path}: Gemma 3 with {key}={raw[key]} is not supported")
    if raw.get("use_bidirectional_attention"):
        raise UnsupportedCheckpointError(f"{path}: Gemma 3 with use_bidirectional_attention is not supported")
    if raw.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise UnsupportedCheckpointError(f"{path}: hidden_activation {raw['hidden_activation']!r} is not supported "
                                         f"(only gelu_pytorch_tanh)")
    # transformers 5: rope_parameters per layer type; 4.x: rope_theta, rope_scaling, rope_local_base_freq
    rope = raw.get("rope_parameters") or {}
    full = dict(rope.get("full_attention") or raw.get("rope_scaling") or {})
    full.setdefault("rope_theta", raw.get("rope_theta", 1_000_000.0))
    local = dict(rope.get("sliding_attention") or {"rope_theta": raw.get("rope_local_base_freq", 10_000.0)})
    if local.get("rope_type", "default") != "default":
        raise UnsupportedCheckpointError(f"{path}: scaled RoPE on Gemma 3's sliding-window layers is not supported")
    n = raw["num_hidden_layers"]
    types = raw.get("layer_types") or ["sliding_attention" if (i + 1) % raw.get("sliding_window_pattern", 6)
                                       else "full_attention" for i in range(n)]
    llama = _llama_config({**raw, "hidden_act": "silu", "rope_parameters": full, "tie_word_embeddings":
                           raw.get("tie_word_embeddings", True)}, path, "Gemma3ForCausalLM")
    return dataclasses.replace(llama, sliding_window=raw.get("sliding_window"), layer_types=types,
                               query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar", 256)),
                               rope_local_theta=float(local.get("rope_theta", 10_000.0)))


def _gpt_oss_config(raw: dict, path: Path) -> LlamaConfig:
    """GptOssForCausalLM: Llama's fields with q/k/v/o biases, sliding-window and full-attention
    layers alternating (``layer_types``), YaRN RoPE, and experts in every layer; quantized
    (MXFP4) weights are refused."""
    quant = raw.get("quantization_config")
    if quant:
        raise UnsupportedCheckpointError(
            f"{path}: {quant.get('quant_method', 'quantized')} gpt-oss weights are not supported; dequantize them "
            f"(transformers: Mxfp4Config(dequantize=True)) and save_pretrained the result")
    n = raw["num_hidden_layers"]
    defaults = dict(layer_types=["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)],
                    attention_bias=True, rms_norm_eps=1e-5, rope_theta=150000.0)
    if not (raw.get("rope_parameters") or raw.get("rope_scaling")):  # GptOssConfig's default
        defaults["rope_parameters"] = dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                                           original_max_position_embeddings=4096)
    llama = _llama_config({**defaults, **{k: v for k, v in raw.items() if v is not None}, "hidden_act": "silu"},
                          path, "GptOssForCausalLM")
    return dataclasses.replace(llama, num_experts=raw["num_local_experts"],
                               num_experts_per_tok=raw["num_experts_per_tok"],
                               moe_intermediate_size=raw["intermediate_size"], norm_topk_prob=True,
                               swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)),
                               swiglu_limit=float(raw.get("swiglu_limit", 7.0)))


def _eos(raw: dict) -> int | None:
    """The config's EOS id; Llama 3 lists several (end of text, end of turn): the first is taken."""
    eos = raw.get("eos_token_id")
    return eos[0] if isinstance(eos, list) and eos else eos if isinstance(eos, int) else None


def _dtype(raw: dict) -> str | None:
    return raw.get("torch_dtype") or raw.get("dtype")


def default_dtype(model_config: ModelArchConfig, device_type: str) -> str:
    """float32 on the CPU (its matmuls are fastest there, and the references are exact);
    on CUDA the checkpoint's bfloat16 when it is stored so (float16 would overflow where
    bfloat16 does not), float16 otherwise (vLLM's dtype="auto")."""
    if device_type != "cuda":
        return "float32"
    return "bfloat16" if model_config.torch_dtype == "bfloat16" else "float16"


def verify_checksums(path: Path) -> int:
    """Check every file listed in path/SHA256SUMS (``sha256sum`` format); return how many.
    No SHA256SUMS file: nothing to check, 0."""
    sums = path / CHECKSUM_FILE
    if not sums.exists():
        return 0
    n = 0
    for line in sums.read_text().splitlines():
        if not line.strip():
            continue
        want, name = line.split(maxsplit=1)
        name = name.lstrip("*")
        f = path / name
        if not f.exists():
            raise ChecksumMismatchError(f"{f} is missing (listed in {sums})")
        got = hashlib.sha256(f.read_bytes()).hexdigest()
        if got != want:
            raise ChecksumMismatchError(
                f"{f} is corrupted: its sha256 is {got[:12]}…, {sums.name} says {want[:12]}…. "
                f"Restore the file (e.g. `git checkout -- {name}` in its directory, or reinstall)")
        n += 1
    return n


def check_checkpoint(path: Path) -> None:
    verify_checksums(path)
    read_config(path)
    weight_files(path)
    if not any((path / f).exists() for f in TOKENIZER_FILES):
        raise UnsupportedCheckpointError(f"{path} has no tokenizer (looked for {', '.join(TOKENIZER_FILES)})")


def weight_files(path: Path) -> list[Path]:
    """The checkpoint's weight files: the shards its index lists, else its safetensors files,
    else pytorch_model.bin. A shard the index names but the directory lacks is an error."""
    index = path / SHARD_INDEX
    if index.exists():
        files = [path / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise UnsupportedCheckpointError(f"{path}: {SHARD_INDEX} lists shards that are missing: {missing[:3]}")
        return files
    files = sorted(path.glob("model*.safetensors")) or [f for f in [path / "pytorch_model.bin"] if f.exists()]
    if not files:
        raise UnsupportedCheckpointError(f"{path} has no weights (looked for {', '.join(WEIGHT_FILES)}, {SHARD_INDEX})")
    return files


def load_state_dict(path: Path, progress: Callable[[int, int], None] | None = None) -> dict[str, torch.Tensor]:
    """All weights of the checkpoint, in their stored dtype, with GPT-2's ``transformer.``
    prefix removed. progress(bytes read, bytes in all): after each tensor of a safetensors file
    (a .bin file is read in one go)."""
    files = weight_files(path)
    state: dict[str, torch.Tensor] = {}
    if files[0].suffix == ".safetensors":
        from safetensors import safe_open
        total, done = sum(f.stat().st_size for f in files), 0
        for f in files:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():
                    state[name] = t = st.get_tensor(name)
                    done += t.numel() * t.element_size()
                    if progress is not None:
                        progress(min(done, total), total)
        if progress is not None:  # the files also hold headers: the last tensor is not quite `total`
            progress(total, total)
    else:
        import torch

        state = torch.load(files[0], map_location="cpu", weights_only=True)
        if progress is not None:
            size = files[0].stat().st_size
            progress(size, size)
    return {k.removeprefix("transformer."): v for k, v in state.items()}
