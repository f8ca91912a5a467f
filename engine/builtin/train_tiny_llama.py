"""Train the built-in ``tiny-llama``: a small Llama with grouped-query attention (8 query heads
sharing 2 KV heads) on the same corpus and with the same tokenizer as ``tiny-gpt2``.

    python -m engine.builtin.train_tiny_llama                 # writes engine/builtin/tiny-llama/
    python -m engine.builtin.train_tiny_llama --steps 20 --out /tmp/t   # a quick look

The model is Hugging Face's own ``LlamaForCausalLM`` (RoPE, RMSNorm, SwiGLU, an untied LM head),
so what is saved is an ordinary Llama checkpoint. Its weights are saved as bfloat16, as most
Llama-family checkpoints are: half the bytes, and the loader's bf16 path runs on every load.
The tokenizer is tiny-gpt2's file, copied (not retrained), so both models read the same ids.

Shorter than tiny-gpt2's run (which took 39 minutes): sequences of 256 tokens, a few hundred
steps; the model card in the README gives the loss it reached against the unigram baseline.
Deterministic as train_tiny_gpt2 is (one seed, one thread).
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from engine import builtin_model
from engine.builtin import tiny_corpus
from engine.builtin.train_tiny_gpt2 import (
    batch,
    encode,
    evaluate,
    evaluate_all,
    lr_at,
    sha256,
    split_documents,
    unigram_loss,
)
from engine.model_executor.model_loader import CHECKSUM_FILE

ARTIFACT_DIR = builtin_model.PACKAGED.parent / builtin_model.LLAMA_NAME
TOKENIZER_DIR = builtin_model.PACKAGED
CHECKED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


@dataclass
class TrainConfig:
    """Everything that decides the result; saved next to the weights as train_config.json."""
    num_hidden_layers: int = 4
    hidden_size: int = 128
    intermediate_size: int = 384  # SwiGLU: ~8/3 x hidden, rounded up to a multiple of 128
    num_attention_heads: int = 8
    num_key_value_heads: int = 2
    max_position_embeddings: int = 512
    rope_theta: float = 10000.0
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
    threads: int = 1


def model_config(cfg: TrainConfig, vocab_size: int, eot: int):
    from transformers import LlamaConfig
    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, max_position_embeddings=cfg.max_position_embeddings,
        rope_theta=cfg.rope_theta, rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=eot,
        eos_token_id=eot, attn_implementation="sdpa")


def save(out: Path, model, cfg: TrainConfig, eot: int, card: dict) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    conf = model.config.to_dict()
    keep = ["model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings",
            "rms_norm_eps", "rope_parameters", "attention_bias", "mlp_bias", "tie_word_embeddings",
            "bos_token_id", "eos_token_id", "initializer_range"]
    conf = {"architectures": ["LlamaForCausalLM"], **{k: conf.get(k) for k in keep},
            "rope_theta": cfg.rope_theta, "rope_scaling": None, "torch_dtype": "bfloat16"}
    (out / "config.json").write_text(json.dumps(conf, indent=2) + "\n")
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(TOKENIZER_DIR / f, out / f)
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": eot, "eos_token_id": eot}) + "\n")
    (out / "train_config.json").write_text(json.dumps({"config": asdict(cfg), **card}, indent=2) + "\n")
    (out / CHECKSUM_FILE).write_text("".join(f"{sha256(out / f)}  {f}\n" for f in CHECKED_FILES))


def main(argv: list[str] | None = None) -> int:
    d = TrainConfig()
    ap = argparse.ArgumentParser(
        prog="python -m engine.builtin.train_tiny_llama", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--out", type=Path, default=ARTIFACT_DIR, help="where to write the checkpoint")
    for name in ("steps", "batch_size", "seq_len", "seed", "threads", "eval_every"):
        ap.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name))
    ap.add_argument("--lr", type=float, default=d.lr)
    args = ap.parse_args(argv)
    cfg = TrainConfig(**{k: getattr(args, k) for k in asdict(d) if hasattr(args, k)})

    from tokenizers import Tokenizer
    from tqdm import tqdm
    from transformers import LlamaForCausalLM

    t0 = time.perf_counter()
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    print("building the corpus from installed documentation ...", flush=True)
    sources = tiny_corpus.build()
    corpus_hash = tiny_corpus.corpus_sha256(sources)
    train_docs, val_docs = split_documents(sources, cfg.val_every_n_docs)
    tok = Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json"))
    eot = tok.token_to_id(tiny_corpus.EOT)
    train, val = encode(tok, train_docs, eot), encode(tok, val_docs, eot)
    val_bytes = sum(len(doc.encode()) for doc in val_docs) + len(val_docs) * len(tiny_corpus.EOT)
    print(f"  corpus sha256 {corpus_hash[:16]}; train {len(train):,} tokens, val {len(val):,} tokens; "
          f"{time.perf_counter() - t0:.0f} s so far", flush=True)

    model = LlamaForCausalLM(model_config(cfg, tok.get_vocab_size(), eot))
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
    g = torch.Generator().manual_seed(cfg.seed)
    print(f"model: {cfg.num_hidden_layers} layers, {cfg.hidden_size} wide, {cfg.num_attention_heads} query heads, "
          f"{cfg.num_key_value_heads} KV heads, {n_params:,} parameters; {cfg.steps} steps of "
          f"{cfg.batch_size}x{cfg.seq_len} tokens", flush=True)
    t_train = time.perf_counter()
    log, smooth = [], None
    bar = tqdm(range(cfg.steps), desc="training", unit="step", file=sys.stdout, mininterval=5.0)
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        x, y = batch(train, cfg, g)
        loss = model(input_ids=x).logits.flatten(0, 1).float().log_softmax(-1).gather(1, y.reshape(-1, 1)).neg().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        smooth = loss.item() if smooth is None else 0.98 * smooth + 0.02 * loss.item()
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            v = evaluate(model, val, cfg)
            log.append({"step": step + 1, "train": round(smooth, 4), "val": round(v, 4)})
            bar.write(f"step {step + 1:5d}  train loss {smooth:.3f}  val loss {v:.3f} nats/token")
    bar.close()
    train_s = time.perf_counter() - t_train
    with torch.no_grad():  # the loss of the weights as saved (bfloat16)
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16))
    val_loss = round(evaluate_all(model, val, cfg), 4)
    uni = unigram_loss(train, val, tok.get_vocab_size())
    bpb = val_loss * len(val) / val_bytes / math.log(2)
    card = {"corpus_sha256": corpus_hash, "train_tokens": len(train), "val_tokens": len(val), "val_bytes": val_bytes,
            "parameters": n_params, "val_loss_nats_per_token": val_loss, "val_bits_per_byte": round(bpb, 4),
            "unigram_nats_per_token": round(uni, 4),
            "unigram_bits_per_byte": round(uni * len(val) / val_bytes / math.log(2), 4),
            "train_seconds": round(train_s), "total_seconds": round(time.perf_counter() - t0),
            "torch": torch.__version__, "python": sys.version.split()[0], "log": log}
    save(args.out, model, cfg, eot, card)
    print(f"validation: {val_loss:.3f} nats/token = {bpb:.3f} bits/byte "
          f"(unigram baseline {uni:.3f} nats/token = {card['unigram_bits_per_byte']:.3f} bits/byte)")
    print(f"wrote {args.out} in {card['total_seconds']} s ({train_s:.0f} s training)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
