"""Train the built-in ``tiny-gpt2``: a byte-level BPE tokenizer and a small GPT-2 on the English
documentation that ships with Python and permissively licensed packages (see ``tiny_corpus``).

    python -m engine.builtin.train_tiny_gpt2                 # writes engine/builtin/tiny-gpt2/
    python -m engine.builtin.train_tiny_gpt2 --steps 50 --out /tmp/t   # a quick look
    python -m engine.builtin.train_tiny_gpt2 --preset draft  # writes engine/builtin/tiny-gpt2-draft/

The ``draft`` preset trains ``tiny-gpt2-draft``, the speculative-decoding draft model for
tiny-gpt2: 2 layers instead of 4 and batches of 4 sequences, with tiny-gpt2's tokenizer file
copied (not retrained) so the two models read the same ids, starting from tiny-gpt2's embeddings,
first two blocks and final norm. Measured on 16 greedy requests with k = 3 against tiny-gpt2, a
draft trained the same 1,200 steps from a random start accepted 27 % of its drafts, this one 78 %.
Its model card (docs/model-card.md) gives its loss, its training time and its acceptance rate.

Deterministic: one seed drives the document split, the weight init, the batch order and
dropout-free training on a fixed number of threads, so the same Python installation and
package versions give the same files (the corpus hash printed first says whether the text
was the same). The model is Hugging Face's own ``GPT2LMHeadModel``, so what is saved is an
ordinary GPT-2 checkpoint that the engine loads like any other.
"""
from __future__ import annotations

import argparse
import hashlib
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
from engine.model_executor.model_loader import CHECKSUM_FILE

ARTIFACT_DIR = builtin_model.PACKAGED
CHECKED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


@dataclass
class TrainConfig:
    """Everything that decides the result; saved next to the weights as train_config.json."""
    vocab_size: int = 4096
    n_layer: int = 4
    n_embd: int = 128
    n_head: int = 4
    n_positions: int = 512
    seq_len: int = 512
    batch_size: int = 8
    steps: int = 1800
    lr: float = 3e-3
    warmup: int = 40
    weight_decay: float = 0.1
    val_every_n_docs: int = 50
    eval_every: int = 50
    eval_batches: int = 4
    seed: int = 1234
    threads: int = 1  # one thread: under CPU contention two spent 2.4x the CPU per step (spinning)
    tokenizer_from: str = ""  # a built-in model whose tokenizer is reused; empty: train one
    init_from: str = ""  # a built-in model whose embeddings, first n_layer blocks and final norm start the weights


# name -> (output directory, the settings that differ from TrainConfig's defaults)
PRESETS = {
    builtin_model.NAME: (ARTIFACT_DIR, {}),
    "draft": (ARTIFACT_DIR.parent / builtin_model.DRAFT_NAME,
              dict(n_layer=2, batch_size=4, steps=1200, lr=2e-3, tokenizer_from=builtin_model.NAME,
                   init_from=builtin_model.NAME)),
}


def split_documents(sources: list[tiny_corpus.Source], every: int) -> tuple[list[str], list[str]]:
    """Every `every`-th document of each source is held out for validation."""
    train, val = [], []
    for s in sources:
        for i, d in enumerate(s.documents):
            (val if i % every == every // 2 else train).append(d)
    return train, val


def train_tokenizer(docs: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    # GPT-2's pre-tokenizer: split on its regex (words keep their leading space, shown as Ġ),
    # then map every byte to a printable character so any text is encodable
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[tiny_corpus.EOT], min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(docs, trainer=trainer)
    return tok


def encode(tok, docs: list[str], eot: int) -> torch.Tensor:
    ids: list[int] = []
    for enc in tok.encode_batch_fast(docs):
        ids += enc.ids
        ids.append(eot)
    return torch.tensor(ids, dtype=torch.int32)


def batch(data: torch.Tensor, cfg: TrainConfig, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    starts = torch.randint(0, len(data) - cfg.seq_len - 1, (cfg.batch_size,), generator=g)
    x = torch.stack([data[s:s + cfg.seq_len + 1] for s in starts.tolist()]).long()
    return x[:, :-1], x[:, 1:]


def model_config(cfg: TrainConfig, eot: int):
    from transformers import GPT2Config
    return GPT2Config(vocab_size=cfg.vocab_size, n_positions=cfg.n_positions, n_embd=cfg.n_embd,
                      n_layer=cfg.n_layer, n_head=cfg.n_head, activation_function="gelu_new",
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=eot, eos_token_id=eot,
                      tie_word_embeddings=True, attn_implementation="sdpa")


@torch.no_grad()
def evaluate(model, data: torch.Tensor, cfg: TrainConfig) -> float:
    """Mean next-token loss (nats) over fixed windows of `data` (the same windows every time)."""
    model.eval()
    g = torch.Generator().manual_seed(cfg.seed + 1)
    losses = []
    for _ in range(cfg.eval_batches):
        x, y = batch(data, cfg, g)
        losses.append(model(input_ids=x, labels=None).logits.flatten(0, 1).float()
                      .log_softmax(-1).gather(1, y.reshape(-1, 1)).neg().mean().item())
    model.train()
    return sum(losses) / len(losses)


@torch.no_grad()
def evaluate_all(model, data: torch.Tensor, cfg: TrainConfig) -> float:
    """Mean next-token loss (nats) over all of `data`, in consecutive windows of seq_len."""
    model.eval()
    total, n = 0.0, 0
    for s in range(0, len(data) - 1, cfg.seq_len):
        x = data[s:s + cfg.seq_len + 1].long()
        logits = model(input_ids=x[None, :-1]).logits[0].float()
        total += logits.log_softmax(-1).gather(1, x[1:, None]).neg().sum().item()
        n += len(x) - 1
    return total / n


def unigram_loss(train: torch.Tensor, val: torch.Tensor, vocab_size: int) -> float:
    """Cross-entropy (nats/token) of validation tokens under the training set's token frequencies
    (add-one smoothed): the loss of a model that ignores context."""
    counts = torch.bincount(train.long(), minlength=vocab_size).double() + 1
    logp = (counts / counts.sum()).log()
    return -logp[val.long()].mean().item()


def init_weights(model, path: Path) -> None:
    """Start from another checkpoint of the same width: its embeddings, its first blocks (as many as
    `model` has) and its final layer norm. A draft model starting from its target's lower layers
    begins where the target's representation does, and agrees with it more once trained."""
    from safetensors.torch import load_file

    own = model.state_dict()
    state = {k: v for k, v in load_file(str(path / "model.safetensors")).items()
             if k in own and own[k].shape == v.shape}
    missing = [k for k in own if k not in state and k != "lm_head.weight"]
    if missing:
        raise SystemExit(f"{path} cannot start this model: it lacks {missing[:3]} (another width?)")
    model.load_state_dict(state, strict=False)
    model.tie_weights()


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))  # cosine to 10 %


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def save(out: Path, model, tok, cfg: TrainConfig, eot: int, card: dict) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    conf = model.config.to_dict()
    keep = ["model_type", "architectures", "vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "n_inner",
            "activation_function", "layer_norm_epsilon", "initializer_range", "bos_token_id", "eos_token_id",
            "tie_word_embeddings", "scale_attn_weights", "scale_attn_by_inverse_layer_idx",
            "reorder_and_upcast_attn", "resid_pdrop", "embd_pdrop", "attn_pdrop"]
    conf["architectures"] = ["GPT2LMHeadModel"]
    (out / "config.json").write_text(json.dumps({k: conf.get(k) for k in keep}, indent=2) + "\n")
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    if cfg.tokenizer_from:  # byte for byte the same files, so a loader comparing them finds them equal
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(builtin_model.PACKAGED_MODELS[cfg.tokenizer_from] / f, out / f)
    else:
        tok.save(str(out / "tokenizer.json"))
        (out / "tokenizer_config.json").write_text(json.dumps({
            "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tiny_corpus.EOT, "eos_token": tiny_corpus.EOT,
            "unk_token": None, "model_max_length": cfg.n_positions, "clean_up_tokenization_spaces": False,
        }, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": eot, "eos_token_id": eot}) + "\n")
    (out / "train_config.json").write_text(json.dumps({"config": asdict(cfg), **card}, indent=2) + "\n")
    (out / CHECKSUM_FILE).write_text("".join(f"{sha256(out / f)}  {f}\n" for f in CHECKED_FILES))


def version_drift(sources: list[tiny_corpus.Source]) -> list[str]:
    """What differs from the corpus the committed model was trained on: the text comes from the
    installed packages, so another version of one (a newer transformers) changes the corpus, the
    tokenizer and every weight. One line per source that differs."""
    card = ARTIFACT_DIR / "train_config.json"
    if not card.is_file():
        return []
    trained = {s["name"].rsplit(" ", 1)[0]: s["name"] for s in json.loads(card.read_text()).get("sources", [])}
    lines = []
    for s in sources:
        base = s.name.rsplit(" ", 1)[0]
        if base in trained and trained[base] != s.name:
            lines.append(f"{s.name} is installed; the committed model was trained with {trained[base]} "
                         "(a different corpus: install that version to reproduce it)")
    return lines


def main(argv: list[str] | None = None) -> int:
    d = TrainConfig()
    ap = argparse.ArgumentParser(prog="python -m engine.builtin.train_tiny_gpt2", description=__doc__.split("\n\n")[0])

    def default(name: str) -> str:
        others = "".join(f"; {p}: {o[name]}" for p, (_, o) in PRESETS.items() if name in o)
        return f"default: {getattr(d, name)}{others}"

    ap.add_argument("--preset", choices=sorted(PRESETS), default=builtin_model.NAME,
                    help=f"which built-in model to train: its output directory and settings "
                         f"(default: {builtin_model.NAME})")
    ap.add_argument("--out", type=Path, default=None,
                    help="where to write the checkpoint (default: the preset's directory)")
    for name in ("steps", "batch_size", "seq_len", "n_layer", "n_embd", "n_head", "vocab_size", "seed", "threads",
                 "eval_every"):
        ap.add_argument("--" + name.replace("_", "-"), type=int, default=None, help=default(name))
    ap.add_argument("--lr", type=float, default=None, help=default("lr"))
    args = ap.parse_args(argv)
    preset_dir, preset = PRESETS[args.preset]
    args.out = args.out or preset_dir
    cfg = TrainConfig(**{**asdict(d), **preset,
                         **{k: v for k, v in vars(args).items() if k in asdict(d) and v is not None}})
    if cfg.n_embd % cfg.n_head or cfg.seq_len > cfg.n_positions or cfg.steps < 1:
        ap.error("need n_embd divisible by n_head, seq_len <= n_positions and steps >= 1")

    from tqdm import tqdm
    from transformers import GPT2LMHeadModel

    t0 = time.perf_counter()
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    print("building the corpus from installed documentation ...", flush=True)
    sources = tiny_corpus.build()
    corpus_hash = tiny_corpus.corpus_sha256(sources)
    n_chars = sum(len(doc) for s in sources for doc in s.documents)
    print(f"  {sum(len(s.documents) for s in sources)} documents, {n_chars:,} characters, sha256 {corpus_hash[:16]}")
    for line in version_drift(sources):
        print("  note: " + line, flush=True)
    train_docs, val_docs = split_documents(sources, cfg.val_every_n_docs)
    if cfg.tokenizer_from:
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(str(builtin_model.PACKAGED_MODELS[cfg.tokenizer_from] / "tokenizer.json"))
    else:
        tok = train_tokenizer(train_docs, cfg.vocab_size)
    eot = tok.token_to_id(tiny_corpus.EOT)
    train, val = encode(tok, train_docs, eot), encode(tok, val_docs, eot)
    val_bytes = sum(len(doc.encode()) for doc in val_docs) + len(val_docs) * len(tiny_corpus.EOT)
    print(f"  tokenizer: {tok.get_vocab_size()} tokens; train {len(train):,} tokens, val {len(val):,} tokens "
          f"({val_bytes / len(val):.2f} bytes/token); {time.perf_counter() - t0:.0f} s so far", flush=True)

    model = GPT2LMHeadModel(model_config(cfg, eot))
    if cfg.init_from:
        init_weights(model, builtin_model.PACKAGED_MODELS[cfg.init_from])
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
    g = torch.Generator().manual_seed(cfg.seed)
    print(f"model: {cfg.n_layer} layers, {cfg.n_embd} wide, {cfg.n_head} heads, {n_params:,} parameters; "
          f"{cfg.steps} steps of {cfg.batch_size}x{cfg.seq_len} tokens", flush=True)
    t_train = time.perf_counter()
    log, smooth = [], None
    bar = tqdm(range(cfg.steps), desc="training", unit="step", file=sys.stdout, mininterval=2.0)
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        x, y = batch(train, cfg, g)
        loss = model(input_ids=x, labels=None).logits.flatten(0, 1).float().log_softmax(-1) \
            .gather(1, y.reshape(-1, 1)).neg().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        smooth = loss.item() if smooth is None else 0.98 * smooth + 0.02 * loss.item()
        tok_s = (step + 1) * cfg.batch_size * cfg.seq_len / (time.perf_counter() - t_train)
        bar.set_postfix(train=f"{smooth:.3f}", tok_s=f"{tok_s:.0f}")
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            v = evaluate(model, val, cfg)
            log.append({"step": step + 1, "train": round(smooth, 4), "val": round(v, 4)})
            bar.write(f"step {step + 1:5d}  train loss {smooth:.3f}  val loss {v:.3f} nats/token")
            if step + 1 < cfg.steps:  # a usable checkpoint however far a long run gets
                save(args.out, model, tok, cfg, eot, {"partial": f"step {step + 1} of {cfg.steps}", "log": log})
    bar.close()
    train_s = time.perf_counter() - t_train
    val_loss = round(evaluate_all(model, val, cfg), 4)
    uni = unigram_loss(train, val, cfg.vocab_size)
    bpb = val_loss * len(val) / val_bytes / math.log(2)
    card = {"corpus_sha256": corpus_hash, "sources": [{"name": s.name, "licence": s.licence,
                                                       "documents": len(s.documents),
                                                       "characters": sum(map(len, s.documents))} for s in sources],
            "train_tokens": len(train), "val_tokens": len(val), "val_bytes": val_bytes, "parameters": n_params,
            "val_loss_nats_per_token": val_loss, "val_bits_per_byte": round(bpb, 4),
            "unigram_nats_per_token": round(uni, 4),
            "unigram_bits_per_byte": round(uni * len(val) / val_bytes / math.log(2), 4),
            "train_seconds": round(train_s), "total_seconds": round(time.perf_counter() - t0),
            "torch": torch.__version__, "python": sys.version.split()[0], "log": log}
    save(args.out, model, tok, cfg, eot, card)
    print(f"validation: {val_loss:.3f} nats/token = {bpb:.3f} bits/byte "
          f"(unigram baseline {uni:.3f} nats/token = {card['unigram_bits_per_byte']:.3f} bits/byte)")
    print(f"wrote {args.out} in {card['total_seconds']} s ({train_s:.0f} s training)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
