"""The built-in offline models.

``tiny-gpt2``: a small GPT-2 (4 layers, 128 wide, 4 heads, 512 positions) with a 4,096-token
byte-level BPE tokenizer, trained on English documentation that ships with Python and with
permissively licensed packages (``python -m engine.builtin.train tiny-gpt2``; model card in
docs/model-card.md). Its files are package data (``engine/builtin/tiny-gpt2/``) with a SHA256SUMS file
that ``model_loader.check_checkpoint`` verifies, so it loads with no network through the same
loader as any Hugging Face checkpoint.

``tiny-gpt2-draft``: tiny-gpt2's draft model for speculative decoding (``speculative_config=
{"method": "draft_model", "model": "tiny-gpt2-draft", ...}``): a GPT-2 of 2 layers, 128 wide,
4 heads, started from tiny-gpt2's embeddings and first two blocks and trained by the same script on
the same corpus with tiny-gpt2's tokenizer file (``python -m engine.builtin.train tiny-gpt2-draft``),
packaged the same way (``engine/builtin/tiny-gpt2-draft/``).

``tiny-gpt2-random``: the same architecture at 4 layers, 128 wide, with deterministic random
weights from a fixed seed and a byte-level tokenizer without merges (token id b is the byte b,
256 is <|endoftext|>). Written once in Hugging Face format to a cache directory. Tests whose
subject is the engine, not the text, use it: its ids are bytes, and its greedy outputs vary.

``tiny-llama``: a Llama (4 layers, 128 wide, 8 query heads sharing 2 KV heads, RoPE, RMSNorm,
SwiGLU, untied LM head) trained on the same corpus with the same tokenizer as tiny-gpt2
(``python -m engine.builtin.train tiny-llama``), packaged the same way (``engine/builtin/tiny-llama/``).
``tiny-llama-random`` is its random-weights twin on the byte-level tokenizer, as tiny-gpt2-random is.

``tiny-moe``: a Qwen3-MoE (4 layers, 128 wide, the attention of tiny-llama plus Qwen3's q/k norms,
8 experts of 192 of which each token uses 2, renormalised) trained the same way
(``python -m engine.builtin.train tiny-moe``), packaged in ``engine/builtin/tiny-moe/``; its
random-weights twin on the byte-level tokenizer is ``tiny-moe-random``.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

NAME = "tiny-gpt2"
DRAFT_NAME = "tiny-gpt2-draft"
RANDOM_NAME = "tiny-gpt2-random"
LLAMA_NAME = "tiny-llama"
LLAMA_RANDOM_NAME = "tiny-llama-random"
MOE_NAME = "tiny-moe"
MOE_RANDOM_NAME = "tiny-moe-random"
NAMES = (NAME, DRAFT_NAME, RANDOM_NAME, LLAMA_NAME, LLAMA_RANDOM_NAME, MOE_NAME, MOE_RANDOM_NAME)
PACKAGED = Path(__file__).resolve().parent / "builtin" / NAME
PACKAGED_MODELS = {NAME: PACKAGED, DRAFT_NAME: PACKAGED.parent / DRAFT_NAME, LLAMA_NAME: PACKAGED.parent / LLAMA_NAME,
                   MOE_NAME: PACKAGED.parent / MOE_NAME}
SEED = 1234
CONFIG = dict(
    model_type="gpt2", architectures=["GPT2LMHeadModel"], vocab_size=257, n_positions=512,
    n_embd=128, n_layer=4, n_head=4, n_inner=None, activation_function="gelu_new",
    layer_norm_epsilon=1e-5, initializer_range=0.02, bos_token_id=256, eos_token_id=256,
    tie_word_embeddings=True, scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False,
    reorder_and_upcast_attn=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
)
VERSION = "2"  # bump when CONFIG, SEED or the init changes, so stale caches are rebuilt
LLAMA_CONFIG = dict(
    model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=257, hidden_size=128, intermediate_size=384,
    num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=16, hidden_act="silu",
    max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None, attention_bias=False,
    mlp_bias=False, tie_word_embeddings=False, bos_token_id=256, eos_token_id=256, initializer_range=0.02,
)
LLAMA_VERSION = "1"
MOE_CONFIG = dict(
    model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], vocab_size=257, hidden_size=128,
    intermediate_size=384, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=16,
    hidden_act="silu", max_position_embeddings=512, rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, attention_bias=False,
    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=192, norm_topk_prob=True, decoder_sparse_step=1,
    mlp_only_layers=[], tie_word_embeddings=False, bos_token_id=256, eos_token_id=256, initializer_range=0.02,
)
MOE_VERSION = "1"


class BuiltinModelMissingError(ValueError):
    """The trained tiny-gpt2's files are not installed next to the code."""


def cache_root() -> Path:
    base = os.environ.get("VLLM_TRACE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "vllm-trace")
    return Path(base)


def builtin_path(name: str = NAME) -> Path:
    """Directory of a built-in checkpoint (one of NAMES); a random one is written to the cache
    first if needed."""
    if name in PACKAGED_MODELS:
        path = PACKAGED_MODELS[name]
        if not (path / "model.safetensors").exists():
            raise BuiltinModelMissingError(
                f"the built-in model's files are missing from {path} (an install without package data?). "
                f"Reinstall vllm-trace, or rebuild them: python -m engine.builtin.train {name}")
        return path
    if name == RANDOM_NAME:
        path, config, weights = cache_root() / f"{NAME}-v{VERSION}", CONFIG, _weights
    elif name == LLAMA_RANDOM_NAME:
        path, config, weights = cache_root() / f"{LLAMA_NAME}-v{LLAMA_VERSION}", LLAMA_CONFIG, _llama_weights
    elif name == MOE_RANDOM_NAME:
        path, config, weights = cache_root() / f"{MOE_NAME}-v{MOE_VERSION}", MOE_CONFIG, _moe_weights
    else:
        raise ValueError(f"{name!r} is not a built-in model; those are {', '.join(NAMES)}")
    if not (path / "model.safetensors").exists():
        _write(path, config, weights)
    return path


def _weights() -> dict:
    import torch

    g = torch.Generator().manual_seed(SEED)
    d, v, p, L = CONFIG["n_embd"], CONFIG["vocab_size"], CONFIG["n_positions"], CONFIG["n_layer"]

    def normal(*shape, std=0.02):
        return torch.randn(*shape, generator=g) * std

    # Larger than GPT-2's init: at 0.02 an untrained model repeats one token forever; at these
    # scales greedy outputs vary, which makes the engine's tests sharper. Rows of bytes that are
    # not printable ASCII are shrunk so the (tied) LM head mostly emits readable characters.
    wte = normal(v, d, std=0.5)
    printable = torch.zeros(v, dtype=torch.bool)
    printable[32:127] = True
    wte[~printable] *= 0.2
    w = {"transformer.wte.weight": wte, "transformer.wpe.weight": normal(p, d, std=0.05)}
    for i in range(L):
        pre = f"transformer.h.{i}."
        w |= {
            pre + "ln_1.weight": 1 + normal(d, std=0.1), pre + "ln_1.bias": normal(d),
            pre + "attn.c_attn.weight": normal(d, 3 * d, std=0.5), pre + "attn.c_attn.bias": normal(3 * d),
            pre + "attn.c_proj.weight": normal(d, d, std=0.05), pre + "attn.c_proj.bias": normal(d),
            pre + "ln_2.weight": 1 + normal(d, std=0.1), pre + "ln_2.bias": normal(d),
            pre + "mlp.c_fc.weight": normal(d, 4 * d, std=0.2), pre + "mlp.c_fc.bias": normal(4 * d),
            pre + "mlp.c_proj.weight": normal(4 * d, d, std=0.05), pre + "mlp.c_proj.bias": normal(d),
        }
    w |= {"transformer.ln_f.weight": 1 + normal(d, std=0.1), "transformer.ln_f.bias": normal(d)}
    return w


def _llama_weights() -> dict:
    """Hugging Face Llama names. Scales chosen as for tiny-gpt2-random (greedy outputs vary,
    mostly printable bytes); q and k are large enough that attention is far from uniform."""
    c = LLAMA_CONFIG
    d, f = c["hidden_size"], c["intermediate_size"]
    return _llama_shaped_weights(c, lambda pre, normal: {
        pre + "post_attention_layernorm.weight": 1 + normal(d, std=0.1),
        pre + "mlp.gate_proj.weight": normal(f, d, std=0.2), pre + "mlp.up_proj.weight": normal(f, d, std=0.2),
        pre + "mlp.down_proj.weight": normal(d, f, std=0.05)})


def _moe_weights() -> dict:
    """Hugging Face Qwen3-MoE names, experts fused as transformers 5 saves them. tiny-llama-random's
    scales; the router's rows large enough that tokens spread over the experts (an 82-byte sentence
    reaches 7 or 8 of the 8 in each layer)."""
    c = MOE_CONFIG
    d, hd, e, f = c["hidden_size"], c["head_dim"], c["num_experts"], c["moe_intermediate_size"]
    return _llama_shaped_weights(c, lambda pre, normal: {
        pre + "self_attn.q_norm.weight": 1 + normal(hd, std=0.1),
        pre + "self_attn.k_norm.weight": 1 + normal(hd, std=0.1),
        pre + "post_attention_layernorm.weight": 1 + normal(d, std=0.1),
        pre + "mlp.gate.weight": normal(e, d, std=0.3),
        pre + "mlp.experts.gate_up_proj": normal(e, 2 * f, d, std=0.2),
        pre + "mlp.experts.down_proj": normal(e, d, f, std=0.05)})


def _llama_shaped_weights(c: dict, rest_of_layer) -> dict:
    """The embedding, final norm, head and each layer's attention under Llama's names, drawn in that
    order from one seeded generator; ``rest_of_layer(prefix, normal)`` draws what follows a layer's
    attention (its MLP or experts). Non-printable bytes' rows are shrunk, as in tiny-gpt2-random."""
    import torch

    g = torch.Generator().manual_seed(SEED)
    d, v, hd = c["hidden_size"], c["vocab_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd

    def normal(*shape, std):
        return torch.randn(*shape, generator=g) * std

    printable = torch.zeros(v, 1, dtype=torch.bool)
    printable[32:127] = True
    scale = torch.where(printable, 1.0, 0.2)
    w = {"model.embed_tokens.weight": normal(v, d, std=0.5) * scale, "model.norm.weight": 1 + normal(d, std=0.1),
         "lm_head.weight": normal(v, d, std=0.5) * scale}
    for i in range(c["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        w |= {
            pre + "input_layernorm.weight": 1 + normal(d, std=0.1),
            pre + "self_attn.q_proj.weight": normal(q, d, std=0.3),
            pre + "self_attn.k_proj.weight": normal(kv, d, std=0.3),
            pre + "self_attn.v_proj.weight": normal(kv, d, std=0.3),
            pre + "self_attn.o_proj.weight": normal(d, q, std=0.05),
        }
        w |= rest_of_layer(pre, normal)
    return w


def _tokenizer_json() -> dict:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    # ByteLevel maps each byte to a printable character; ordering the vocab by byte value
    # makes token id == byte value.
    alphabet = ByteLevel.alphabet()
    byte_to_char = _bytes_to_unicode()
    assert set(byte_to_char.values()) == set(alphabet)
    vocab = {byte_to_char[b]: b for b in range(256)}
    vocab["<|endoftext|>"] = 256
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>"])
    return json.loads(tok.to_str())


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable-character table."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def write_byte_tokenizer(path: Path, model_max_length: int) -> None:
    """The byte-level tokenizer of the random models (id b is byte b, 256 is <|endoftext|>)."""
    (path / "tokenizer.json").write_text(json.dumps(_tokenizer_json()))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|endoftext|>",
        "eos_token": "<|endoftext|>", "unk_token": None, "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
    }))


def _write(path: Path, config: dict, weights) -> None:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    try:
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        save_file({k: t.contiguous() for k, t in weights().items()}, str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        write_byte_tokenizer(tmp, config.get("n_positions") or config["max_position_embeddings"])
        (tmp / "generation_config.json").write_text(json.dumps({"bos_token_id": 256, "eos_token_id": 256}))
        (tmp / "README.md").write_text(__doc__)
        try:
            tmp.rename(path)  # atomic: a concurrent writer either wins or finds it done
        except OSError:
            if not (path / "model.safetensors").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
