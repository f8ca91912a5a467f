"""The settings of each built-in model that ``python -m engine.builtin.train`` trains: one dataclass a
model, saved next to its weights as train_config.json "config", and the Hugging Face class it is.

Each shares ``TrainConfig``'s training settings and adds its shape; ``hf_config`` builds the
transformers config, ``config_json`` is what config.json keeps of it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from engine import builtin_model


@dataclass
class TrainConfig:
    """The training settings every built-in model has."""
    seq_len: int = 256
    batch_size: int = 8
    steps: int = 1200
    lr: float = 3e-3
    warmup: int = 30
    weight_decay: float = 0.1
    val_every_n_docs: int = 50
    eval_every: int = 100
    eval_batches: int = 4
    seed: int = 1234
    threads: int = 1  # one thread: under CPU contention two spent 2.4x the CPU per step (spinning)

    model_class: ClassVar[str] = ""
    save_dtype: ClassVar[str] = "float32"
    tie_word_embeddings: ClassVar[bool] = False
    tokenizer_from: ClassVar[str] = builtin_model.NAME  # a built-in model whose tokenizer is reused
    init_from: ClassVar[str] = ""
    vocab_size: ClassVar[int] = 0  # only a model that trains its own tokenizer sets it
    router_aux_loss_coef: ClassVar[float] = 0.0

    @property
    def max_positions(self) -> int:
        return self.max_position_embeddings

    def hf_config(self, vocab_size: int, eot: int):
        raise NotImplementedError

    def config_json(self, model) -> dict:
        raise NotImplementedError

    def card_extras(self, model, val: torch.Tensor, n_params: int) -> dict:
        return {}


@dataclass
class TinyGpt2(TrainConfig):
    vocab_size: int = 4096
    n_layer: int = 4
    n_embd: int = 128
    n_head: int = 4
    n_positions: int = 512
    seq_len: int = 512
    steps: int = 1800
    warmup: int = 40
    eval_every: int = 50
    tokenizer_from: str = ""  # a built-in model whose tokenizer is reused; empty: train one
    init_from: str = ""  # a built-in model whose embeddings, first n_layer blocks and final norm start the weights

    model_class: ClassVar[str] = "GPT2LMHeadModel"
    tie_word_embeddings: ClassVar[bool] = True

    @property
    def max_positions(self) -> int:
        return self.n_positions

    def hf_config(self, vocab_size: int, eot: int):
        from transformers import GPT2Config
        return GPT2Config(vocab_size=self.vocab_size, n_positions=self.n_positions, n_embd=self.n_embd,
                          n_layer=self.n_layer, n_head=self.n_head, activation_function="gelu_new",
                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=eot, eos_token_id=eot,
                          tie_word_embeddings=True, attn_implementation="sdpa")

    def config_json(self, model) -> dict:
        conf = model.config.to_dict()
        keep = ["model_type", "architectures", "vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "n_inner",
                "activation_function", "layer_norm_epsilon", "initializer_range", "bos_token_id", "eos_token_id",
                "tie_word_embeddings", "scale_attn_weights", "scale_attn_by_inverse_layer_idx",
                "reorder_and_upcast_attn", "resid_pdrop", "embd_pdrop", "attn_pdrop"]
        conf["architectures"] = [self.model_class]
        return {k: conf.get(k) for k in keep}


@dataclass
class TinyLlama(TrainConfig):
    num_hidden_layers: int = 4
    hidden_size: int = 128
    intermediate_size: int = 384  # SwiGLU: ~8/3 x hidden, rounded up to a multiple of 128
    num_attention_heads: int = 8
    num_key_value_heads: int = 2
    max_position_embeddings: int = 512
    rope_theta: float = 10000.0

    model_class: ClassVar[str] = "LlamaForCausalLM"
    save_dtype: ClassVar[str] = "bfloat16"

    def hf_config(self, vocab_size: int, eot: int):
        from transformers import LlamaConfig
        return LlamaConfig(
            vocab_size=vocab_size, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers, num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, max_position_embeddings=self.max_position_embeddings,
            rope_theta=self.rope_theta, rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=eot,
            eos_token_id=eot, attn_implementation="sdpa")

    def config_json(self, model) -> dict:
        conf = model.config.to_dict()
        keep = ["model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings",
                "rms_norm_eps", "rope_parameters", "attention_bias", "mlp_bias", "tie_word_embeddings",
                "bos_token_id", "eos_token_id", "initializer_range"]
        return {"architectures": [self.model_class], **{k: conf.get(k) for k in keep},
                "rope_theta": self.rope_theta, "rope_scaling": None, "torch_dtype": "bfloat16"}


@dataclass
class TinyMoe(TrainConfig):
    num_hidden_layers: int = 4
    hidden_size: int = 128
    num_attention_heads: int = 8
    num_key_value_heads: int = 2
    head_dim: int = 16
    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 192  # 2 experts of 192 = tiny-llama's MLP of 384: the same active parameters
    # between Qwen3-MoE's default 0.001 and Mixtral's 0.02; the same run at 0.05 ended 0.02 nats/token worse with
    # its busiest expert at 2.7x an even share instead of 3.6x, and as many nearly idle experts (3)
    router_aux_loss_coef: float = 0.01
    max_position_embeddings: int = 512
    rope_theta: float = 10000.0
    steps: int = 600  # half tiny-llama's 1,200; the model card gives the loss they reach

    model_class: ClassVar[str] = "Qwen3MoeForCausalLM"
    save_dtype: ClassVar[str] = "bfloat16"

    def hf_config(self, vocab_size: int, eot: int):
        from transformers import Qwen3MoeConfig
        return Qwen3MoeConfig(
            vocab_size=vocab_size, hidden_size=self.hidden_size, intermediate_size=2 * self.moe_intermediate_size,
            num_hidden_layers=self.num_hidden_layers, num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
            max_position_embeddings=self.max_position_embeddings,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta}, rms_norm_eps=1e-6,
            num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
            moe_intermediate_size=self.moe_intermediate_size, norm_topk_prob=True, decoder_sparse_step=1,
            mlp_only_layers=[], output_router_logits=True, router_aux_loss_coef=self.router_aux_loss_coef,
            tie_word_embeddings=False, bos_token_id=eot, eos_token_id=eot, attn_implementation="sdpa")

    def config_json(self, model) -> dict:
        conf = model.config.to_dict()
        keep = ["model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings",
                "rms_norm_eps", "rope_parameters", "attention_bias", "use_sliding_window", "sliding_window",
                "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
                "mlp_only_layers", "router_aux_loss_coef", "tie_word_embeddings", "bos_token_id", "eos_token_id",
                "initializer_range"]
        # serving needs no router logits (transformers' default), so the checkpoint loads like any Qwen3-MoE
        return {"architectures": [self.model_class], **{k: conf.get(k) for k in keep},
                "num_experts": self.num_experts, "output_router_logits": False, "torch_dtype": "bfloat16"}

    def card_extras(self, model, val: torch.Tensor, n_params: int) -> dict:
        per_expert = 3 * self.hidden_size * self.moe_intermediate_size
        idle = self.num_hidden_layers * (self.num_experts - self.num_experts_per_tok) * per_expert
        load = expert_load(model, val, self.seq_len, self.num_experts_per_tok)
        return {"active_parameters": n_params - idle, "expert_load": load,
                "expert_load_max_over_mean": round(max(max(row) for row in load) * self.num_experts, 3),
                "expert_load_min_over_mean": round(min(min(row) for row in load) * self.num_experts, 3)}


@torch.no_grad()
def expert_load(model, data: torch.Tensor, seq_len: int, top_k: int) -> list[list[float]]:
    """Per layer, each expert's share of the validation tokens' expert slots (each token fills
    top_k): 1 / num_experts each when the router spreads them evenly."""
    model.eval()
    counts = None
    for s in range(0, len(data) - 1, seq_len):
        x = data[s:s + seq_len].long()
        logits = model(input_ids=x[None], output_router_logits=True).router_logits
        chosen = [layer.topk(top_k, dim=-1).indices.flatten() for layer in logits]
        n = torch.stack([torch.bincount(c, minlength=layer.shape[-1]) for c, layer in zip(chosen, logits)])
        counts = n if counts is None else counts + n
    return [[round(v, 4) for v in (row / row.sum()).tolist()] for row in counts.double()]


# name -> settings
MODELS: dict[str, TrainConfig] = {
    builtin_model.NAME: TinyGpt2(),
    builtin_model.DRAFT_NAME: TinyGpt2(n_layer=2, batch_size=4, steps=1200, lr=2e-3,
                                       tokenizer_from=builtin_model.NAME, init_from=builtin_model.NAME),
    builtin_model.LLAMA_NAME: TinyLlama(),
    builtin_model.MOE_NAME: TinyMoe(),
}
