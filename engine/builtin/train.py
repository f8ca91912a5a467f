"""Train a built-in model: ``tiny-gpt2``, its draft ``tiny-gpt2-draft``, ``tiny-llama`` or ``tiny-moe``.

    python -m engine.builtin.train tiny-gpt2                 # writes engine/builtin/tiny-gpt2/
    python -m engine.builtin.train tiny-moe --steps 20 --out /tmp/t   # a quick look

One loop, one evaluation, one way of saving and one model card for every built-in model; what a
model adds is its settings (a dataclass below) and its Hugging Face class, so what is saved is an
ordinary checkpoint of that class that the engine loads like any other:

- ``tiny-gpt2``: ``GPT2LMHeadModel``, and the byte-level BPE tokenizer the others reuse, trained
  here on the English documentation that ships with Python and permissively licensed packages
  (``tiny_corpus``).
- ``tiny-gpt2-draft``: tiny-gpt2's speculative-decoding draft: 2 layers, started from tiny-gpt2's
  embeddings, first two blocks and final norm. Measured on 16 greedy requests with k = 3 against
  tiny-gpt2, a draft trained the same 1,200 steps from a random start accepted 27 % of its drafts,
  this one 78 %.
- ``tiny-llama``: ``LlamaForCausalLM`` with grouped-query attention, saved as bfloat16.
- ``tiny-moe``: ``Qwen3MoeForCausalLM``, 8 experts of which each token uses 2, sized so that the
  parameters a token passes through match tiny-llama's. Trained with transformers' load-balancing
  loss (``router_aux_loss_coef`` x ``load_balancing_loss_func``), which keeps the router from
  sending most tokens to a few experts; its card records each expert's share of the validation tokens.

Deterministic: one seed drives the document split, the weight init and the batch order, and
training runs dropout-free on a fixed number of threads (one: under CPU contention two spent 2.4x
the CPU per step, spinning), so the same Python installation and package versions give the same
files (the corpus hash printed first says whether the text was the same).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, fields
from pathlib import Path

import torch

from engine import builtin_model
from engine.builtin import tiny_corpus
from engine.builtin.train_configs import MODELS, TrainConfig
from engine.builtin.train_data import (
    batch,
    encode,
    evaluate,
    evaluate_all,
    init_weights,
    lr_at,
    save,
    split_documents,
    train_tokenizer,
    unigram_loss,
    version_drift,
)

SAMPLE_PROMPTS = ("The first argument is", "If the file does not exist,")
SAMPLE_TOKENS = 32


def parse_args(argv: list[str] | None) -> tuple[str, TrainConfig | None, Path]:
    """(model, its settings with the options applied, output directory); no settings for --card."""
    ap = argparse.ArgumentParser(prog="python -m engine.builtin.train", description=__doc__.split("\n\n")[0])
    ap.add_argument("model", choices=list(MODELS), help="which built-in model to train")
    ap.add_argument("--out", type=Path, default=None,
                    help="where to write the checkpoint (default: the model's package directory)")
    for name in ("steps", "batch_size", "seq_len", "seed", "threads", "eval_every"):
        ap.add_argument("--" + name.replace("_", "-"), type=int, default=None, help="default: the model's")
    ap.add_argument("--lr", type=float, default=None, help="default: the model's")
    ap.add_argument("--card", action="store_true",
                    help="print the model card's measured lines (docs/model-card.md) from OUT/train_config.json")
    args = ap.parse_args(argv)
    out = args.out or builtin_model.PACKAGED.parent / args.model
    if args.card:
        return args.model, None, out
    base = MODELS[args.model]
    names = {f.name for f in fields(base)}
    cfg = type(base)(**{**asdict(base), **{k: v for k, v in vars(args).items() if k in names and v is not None}})
    if cfg.steps < 1 or cfg.seq_len > cfg.max_positions:
        ap.error(f"need steps >= 1 and seq_len <= {cfg.max_positions}")
    return args.model, cfg, out


def load_data(cfg: TrainConfig, t0: float) -> dict:
    """The corpus, the tokenizer (trained, or another built-in model's) and both splits as ids."""
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
    return dict(sources=sources, corpus_hash=corpus_hash, tok=tok, eot=eot, train=train, val=val,
                val_bytes=val_bytes)


def build_model(cfg: TrainConfig, tok, eot: int):
    import transformers

    model = getattr(transformers, cfg.model_class)(cfg.hf_config(tok.get_vocab_size(), eot))
    if cfg.init_from:
        init_weights(model, builtin_model.PACKAGED_MODELS[cfg.init_from])
    model.train()
    return model


def step_loss(model, x: torch.Tensor, y: torch.Tensor, cfg: TrainConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(the loss to minimise, the next-token loss): they differ by a mixture of experts'
    load-balancing loss, which transformers computes when the config asks for router logits."""
    out = model(input_ids=x)
    ce = out.logits.flatten(0, 1).float().log_softmax(-1).gather(1, y.reshape(-1, 1)).neg().mean()
    aux = getattr(out, "aux_loss", None)
    return (ce if aux is None else ce + cfg.router_aux_loss_coef * aux), ce


def train_loop(model, cfg: TrainConfig, data: dict, out: Path) -> list[dict]:
    from tqdm import tqdm

    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
    g = torch.Generator().manual_seed(cfg.seed)
    t_train = time.perf_counter()
    log, smooth = [], None
    bar = tqdm(range(cfg.steps), desc="training", unit="step", file=sys.stdout, mininterval=5.0)
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        x, y = batch(data["train"], cfg, g)
        loss, ce = step_loss(model, x, y, cfg)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        smooth = ce.item() if smooth is None else 0.98 * smooth + 0.02 * ce.item()
        tok_s = (step + 1) * cfg.batch_size * cfg.seq_len / (time.perf_counter() - t_train)
        bar.set_postfix(train=f"{smooth:.3f}", tok_s=f"{tok_s:.0f}")
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            v = evaluate(model, data["val"], cfg)
            log.append({"step": step + 1, "train": round(smooth, 4), "val": round(v, 4)})
            bar.write(f"step {step + 1:5d}  train loss {smooth:.3f}  val loss {v:.3f} nats/token  "
                      f"{time.perf_counter() - t_train:.0f} s", file=sys.stdout)
            if step + 1 < cfg.steps:  # a usable checkpoint however far a long run gets
                save(out, model, data["tok"], cfg, data["eot"], {"partial": f"step {step + 1} of {cfg.steps}",
                                                                  "log": log})
    bar.close()
    return log


@torch.no_grad()
def samples(model, tok, eot: int) -> list[dict]:
    """Greedy continuations of two fixed prompts, as the card shows them."""
    model.eval()
    result = []
    for prompt in SAMPLE_PROMPTS:
        ids = torch.tensor([tok.encode(prompt).ids])
        out = model.generate(ids, max_new_tokens=SAMPLE_TOKENS, do_sample=False, eos_token_id=eot, pad_token_id=eot)
        result.append({"prompt": prompt, "greedy": tok.decode(out[0, ids.shape[1]:].tolist())})
    return result


def model_card(model, cfg: TrainConfig, data: dict, log: list[dict], times: tuple[float, float]) -> dict:
    """What the README's model table shows, measured on the weights as saved."""
    if cfg.save_dtype == "bfloat16":
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(torch.bfloat16))
    train, val, val_bytes = data["train"], data["val"], data["val_bytes"]
    val_loss = round(evaluate_all(model, val, cfg), 4)
    uni = unigram_loss(train, val, data["tok"].get_vocab_size())
    n_params = sum(p.numel() for p in model.parameters())
    card = {"corpus_sha256": data["corpus_hash"],
            "sources": [{"name": s.name, "licence": s.licence, "documents": len(s.documents),
                         "characters": sum(map(len, s.documents))} for s in data["sources"]],
            "train_tokens": len(train), "val_tokens": len(val), "val_bytes": val_bytes, "parameters": n_params,
            **cfg.card_extras(model, val, n_params),
            "val_loss_nats_per_token": val_loss,
            "val_bits_per_byte": round(val_loss * len(val) / val_bytes / math.log(2), 4),
            "unigram_nats_per_token": round(uni, 4),
            "unigram_bits_per_byte": round(uni * len(val) / val_bytes / math.log(2), 4),
            "samples": samples(model, data["tok"], data["eot"]),
            "train_seconds": round(times[0]), "total_seconds": round(time.perf_counter() - times[1]),
            "torch": torch.__version__, "python": sys.version.split()[0], "log": log}
    return card


def card_markdown(card: dict) -> str:
    """The measured lines of a model card in docs/model-card.md, from train_config.json (printed by
    ``--card``), so the document's figures are the recorded ones."""
    cfg, sources = card["config"], card.get("sources", [])  # older cards list no sources
    origin = (f"{len(sources)} sources (each one's name, version and licence are in train_config.json; licences: "
              + ", ".join(dict.fromkeys(s["licence"] for s in sources)) + ")") if sources else "the corpus's sources"
    lines = [f"- **Data**: {card['train_tokens']:,} training and {card['val_tokens']:,} held-out tokens of the "
             f"English documentation of {origin}, corpus sha256 `{card['corpus_sha256'][:8]}…`",
             f"- **Parameters**: {card['parameters']:,}"
             + (f", of which a token uses **{card['active_parameters']:,}**" if "active_parameters" in card else ""),
             f"- **Training run**: {cfg['steps']:,} steps of {cfg['batch_size']} × {cfg['seq_len']} tokens, seed "
             f"{cfg['seed']}, {cfg['threads']} thread(s): {card['train_seconds'] / 60:.1f} minutes in the training "
             f"loop, {card['total_seconds'] / 60:.1f} in all (torch {card['torch']}, Python {card['python']})"]
    lines.append(f"- **Validation loss** on the whole held-out set ({card['val_tokens']:,} tokens, the weights as "
                 f"saved): **{card['val_loss_nats_per_token']:.2f} nats/token = {card['val_bits_per_byte']:.2f} "
                 f"bits/byte**, against **{card['unigram_nats_per_token']:.2f} nats/token = "
                 f"{card['unigram_bits_per_byte']:.2f} bits/byte** for the unigram model")
    if "expert_load" in card:
        n = len(card["expert_load"][0])
        rows = "; ".join(f"layer {i}: " + " ".join(f"{v:.0%}" for v in row)
                         for i, row in enumerate(card["expert_load"]))
        lines.append(f"- **Expert load** (each expert's share of the validation tokens' expert slots; even is "
                     f"{1 / n:.1%}): the busiest expert takes {card['expert_load_max_over_mean']:.2f}x an even "
                     f"share, the idlest {card['expert_load_min_over_mean']:.2f}x. {rows}")
    for s in card.get("samples", []):
        lines.append(f"- **Sample** (greedy): *{s['prompt']}* → {json.dumps(s['greedy'], ensure_ascii=False)}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    name, cfg, out = parse_args(argv)
    if cfg is None:
        print(card_markdown(json.loads((out / "train_config.json").read_text())), end="")
        return 0
    t0 = time.perf_counter()
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    data = load_data(cfg, t0)
    model = build_model(cfg, data["tok"], data["eot"])
    print(f"{name}: {cfg.model_class}, {sum(p.numel() for p in model.parameters()):,} parameters; "
          f"{cfg.steps} steps of {cfg.batch_size}x{cfg.seq_len} tokens", flush=True)
    t_train = time.perf_counter()
    log = train_loop(model, cfg, data, out)
    card = model_card(model, cfg, data, log, (time.perf_counter() - t_train, t0))
    save(out, model, data["tok"], cfg, data["eot"], card)
    print(f"validation: {card['val_loss_nats_per_token']:.3f} nats/token = {card['val_bits_per_byte']:.3f} "
          f"bits/byte (unigram baseline {card['unigram_nats_per_token']:.3f} nats/token = "
          f"{card['unigram_bits_per_byte']:.3f} bits/byte)")
    for s in card["samples"]:
        print(f"  {s['prompt']!r} -> {s['greedy']!r}")
    print(f"wrote {out} in {card['total_seconds']} s ({card['train_seconds']} s training)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
