"""Llama, written for a paged KV cache (vLLM's ``models/llama.py``; Qwen3 extends it in qwen3.py).

What differs from GPT-2, layer by layer:

* no position table: rotary embedding rotates q and k by each token's position, inside
  attention and before the KV-cache write (layers/rotary_embedding.py);
* grouped-query attention: num_key_value_heads (often num_attention_heads / 4 or / 8) K and V
  heads, each shared by a group of query heads. The cache holds only the KV heads, so it is
  smaller by the group factor; the attention kernel maps query head h to KV head h // group;
* RMSNorm instead of LayerNorm, SwiGLU (down(silu(gate(x)) · up(x))) instead of GELU, no biases;
* an LM head of its own (tie_word_embeddings is False for most Llamas; Qwen3's small models tie).

Tensor parallelism (vLLM's layers, layers/linear.py), with a ``TPGroup`` of N ranks: q, k, v
in one column-parallel ``qkv_proj`` holding num_heads / N query heads and num_kv_heads / N KV
heads per rank (N must divide both); ``gate_up_proj`` column-parallel; ``o_proj`` and
``down_proj`` row-parallel (an all-reduce each). The embedding and the LM head (the same
module when tied) are vocab-parallel (layers/vocab_parallel_embedding.py), as in gpt2.py: the
logits are all-gathered, so every rank holds them.

Hugging Face stores q, k, v and gate, up as separate tensors; ``load_hf_weights`` stacks each
into its fused parameter through the parameter's ``weight_loader`` (vLLM's
``stacked_params_mapping``).
"""
from __future__ import annotations

import torch
from torch import nn

from engine.distributed.parallel_state import TPGroup
from engine.model_executor.layers.activation import SiluAndMul
from engine.model_executor.layers.attention import AttentionBackend, AttentionMetadata
from engine.model_executor.layers.layernorm import RMSNorm
from engine.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from engine.model_executor.layers.logits_processor import LogitsProcessor
from engine.model_executor.layers.rotary_embedding import get_rope
from engine.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
from engine.model_executor.model_loader import LlamaConfig
from engine.model_executor.models.registry import check_tp_size
from kernels import instrument


class LlamaMLP(nn.Module):
    def __init__(self, cfg: LlamaConfig, tp: TPGroup):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, tp,
                                                       bias=cfg.mlp_bias)
        self.act_fn = SiluAndMul()
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, tp, "mlp.down_proj",
                                           bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer_idx: int, backend: AttentionBackend, tp: TPGroup):
        super().__init__()
        n = tp.world_size
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads // n, cfg.num_kv_heads // n, cfg.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, tp,
                                          bias=cfg.attention_bias)
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, tp, "self_attn.o_proj",
                                        bias=cfg.attention_bias)
        self.rotary_emb = get_rope(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self.scaling = cfg.head_dim ** -0.5
        self.backend, self.layer_idx = backend, layer_idx
        self.sinks: nn.Parameter | None = None  # gpt-oss's attention sinks (gpt_oss.py)

    def qk_norm(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return q, k  # Llama has none (Qwen3's RMSNorm per head: qwen3.py)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.qk_norm(q.view(T, self.num_heads, self.head_dim), k.view(T, self.num_kv_heads, self.head_dim))
        q, k = self.rotary_emb(positions, q, k)  # before the cache write: the cache holds rotated keys
        o = self.backend.forward(q, k, v.view(T, self.num_kv_heads, self.head_dim), kv_cache[0], kv_cache[1], meta,
                                 self.scaling, self.sinks)
        return self.o_proj(o.reshape(T, -1))


class LlamaDecoderLayer(nn.Module):
    attention_cls = LlamaAttention

    def __init__(self, cfg: LlamaConfig, layer_idx: int, backend: AttentionBackend, tp: TPGroup):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = self.attention_cls(cfg, layer_idx, backend, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = self.make_mlp(cfg, layer_idx, backend, tp)

    def make_mlp(self, cfg: LlamaConfig, layer_idx: int, backend: AttentionBackend, tp: TPGroup) -> nn.Module:
        return LlamaMLP(cfg, tp)  # a mixture of experts in its place: qwen3_moe.py, mixtral.py

    def forward(self, positions, x, kv_cache, meta):
        x = x + self.self_attn(positions, self.input_layernorm(x), kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, cfg: LlamaConfig, backend: AttentionBackend, tp: TPGroup, layer_cls: type):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp, "embed_tokens")
        self.layers = nn.ModuleList(layer_cls(cfg, i, backend, tp) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids, positions, kv_caches, meta):
        x = self.embed_tokens(input_ids)
        for i, layer in enumerate(self.layers):
            instrument.set_tags(layer=i)  # labels kernel launches; a no-op unless observed
            x = layer(positions, x, kv_caches[i], meta.for_layer(i))  # its KV-cache group's tables and window
        instrument.set_tags(layer=None)  # nor does the LM head's all-gather
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    model_cls = LlamaModel
    decoder_layer = LlamaDecoderLayer
    # (our fused parameter, Hugging Face's tensor, shard): vLLM's stacked_params_mapping
    stacked_params_mapping = [(".qkv_proj", ".q_proj", "q"), (".qkv_proj", ".k_proj", "k"),
                              (".qkv_proj", ".v_proj", "v"), (".gate_up_proj", ".gate_proj", 0),
                              (".gate_up_proj", ".up_proj", 1)]

    def __init__(self, cfg: LlamaConfig, backend: AttentionBackend, tp: TPGroup | None = None):
        super().__init__()
        self.cfg, self.backend = cfg, backend
        self.tp = tp = tp or TPGroup()
        check_tp_size(cfg, tp.world_size)
        self.model = self.model_cls(cfg, backend, tp, self.decoder_layer)
        # the LM head: its own rows of the (padded) vocabulary on this rank, or the embedding's when tied
        self.lm_head = (self.model.embed_tokens if cfg.tie_word_embeddings else
                        VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp, "lm_head"))
        self.logits_processor = LogitsProcessor(cfg.vocab_size, tp)

    @property
    def rope(self) -> dict:
        """How positions enter the model, for the model runner's trace: RoPE on q and k."""
        scaling = self.cfg.rope_scaling or {}
        return dict(theta=self.cfg.rope_theta, type=scaling.get("rope_type", "default"), head_size=self.cfg.head_dim)

    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata) -> torch.Tensor:
        """Returns the final hidden states [num_tokens, hidden_size]."""
        self.backend.prepare(meta, kv_caches[0][0].shape[1])  # once per forward: indexing all layers share
        return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [rows, vocab_size], on every rank."""
        return self.logits_processor(hidden, self.lm_head.weight)  # this rank's slice of the vocabulary

    def load_hf_weights(self, state: dict[str, torch.Tensor]) -> None:
        """Load a Hugging Face Llama-family state dict: each tensor through its parameter's
        weight_loader (which cuts this rank's shard), q/k/v and gate/up into their fused parameter."""
        params = dict(self.named_parameters())  # a tied lm_head.weight is embed_tokens': listed once
        loaded: dict[str, int] = {}
        for name, w in state.items():
            if "rotary_emb.inv_freq" in name or (name == "lm_head.weight" and self.cfg.tie_word_embeddings):
                continue  # recomputed; tied to embed_tokens
            for fused, hf_name, shard in self.stacked_params_mapping:
                if hf_name in name:
                    name = name.replace(hf_name, fused)
                    break
            else:
                shard = None
            if name not in params:
                raise ValueError(f"unexpected weight {name!r} in checkpoint")
            param = params[name]
            if name.endswith(("embed_tokens.weight", "lm_head.weight")):
                w = (self.model.embed_tokens if "embed" in name else self.lm_head).shard(w)  # vocab-parallel rows
            getattr(param, "weight_loader", _default_loader)(param, w, shard)
            loaded[name] = loaded.get(name, 0) + 1
        missing = [n for n, p in params.items() if loaded.get(n, 0) < getattr(p, "num_shards", 1)]
        if missing:
            raise ValueError(f"checkpoint is missing weights: {missing[:5]}")


def _default_loader(param: nn.Parameter, w: torch.Tensor, shard=None) -> None:
    if tuple(w.shape) != tuple(param.shape):
        raise ValueError(f"weight of shape {tuple(w.shape)} does not fit a parameter of shape {tuple(param.shape)}")
    param.data.copy_(w)
