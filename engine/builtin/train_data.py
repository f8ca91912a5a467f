"""The corpus, batches, evaluation and saving that ``python -m engine.builtin.train`` shares across
every built-in model."""
from __future__ import annotations

import hashlib
import json
import math
import shutil
from dataclasses import asdict
from pathlib import Path

import torch

from engine import builtin_model
from engine.builtin import tiny_corpus
from engine.model_executor.model_loader import CHECKSUM_FILE

CHECKED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


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


def batch(data: torch.Tensor, cfg, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    starts = torch.randint(0, len(data) - cfg.seq_len - 1, (cfg.batch_size,), generator=g)
    x = torch.stack([data[s:s + cfg.seq_len + 1] for s in starts.tolist()]).long()
    return x[:, :-1], x[:, 1:]


@torch.no_grad()
def evaluate(model, data: torch.Tensor, cfg) -> float:
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
def evaluate_all(model, data: torch.Tensor, cfg) -> float:
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


def lr_at(step: int, cfg) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))  # cosine to 10 %


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def version_drift(sources: list[tiny_corpus.Source]) -> list[str]:
    """What differs from the corpus the committed model was trained on: the text comes from the
    installed packages, so another version of one (a newer transformers) changes the corpus, the
    tokenizer and every weight. One line per source that differs."""
    card = builtin_model.PACKAGED / "train_config.json"
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


def save(out: Path, model, tok, cfg, eot: int, card: dict) -> None:
    """config.json, the weights (in cfg.save_dtype; a tied LM head is not stored), the tokenizer
    (copied byte for byte when reused, so a loader comparing the files finds them equal),
    generation_config.json, train_config.json (settings and model card) and SHA256SUMS."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg.config_json(model), indent=2) + "\n")
    dtype = getattr(torch, cfg.save_dtype)
    state = {k: v.detach().to(dtype).contiguous() for k, v in model.state_dict().items()
             if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    if cfg.tokenizer_from:
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(builtin_model.PACKAGED_MODELS[cfg.tokenizer_from] / f, out / f)
    else:
        tok.save(str(out / "tokenizer.json"))
        (out / "tokenizer_config.json").write_text(json.dumps({
            "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tiny_corpus.EOT, "eos_token": tiny_corpus.EOT,
            "unk_token": None, "model_max_length": cfg.max_positions, "clean_up_tokenization_spaces": False,
        }, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": eot, "eos_token_id": eot}) + "\n")
    (out / "train_config.json").write_text(json.dumps({"config": asdict(cfg), **card}, indent=2) + "\n")
    (out / CHECKSUM_FILE).write_text("".join(f"{sha256(out / f)}  {f}\n" for f in CHECKED_FILES))
