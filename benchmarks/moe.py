"""Mixture of experts: the fused-MoE reference against a per-expert loop, and expert parallelism
against tensor parallelism, in one run.

    python -m benchmarks.moe [--reps 3] [--requests 8] [--prompt-tokens 32] [--decode-steps 8]

1. One MoE layer (E=8 experts, top-2, hidden 512, expert width 1024, float32) on T tokens:
   ``fused_moe_ref`` (the torch backend: the (token, expert) pairs in expert blocks, each GEMM one
   batched matmul) against the per-expert loop transformers runs (for each expert some token
   chose: gather its tokens, two matmuls, scatter back), medians of interleaved calls.
2. A random Qwen3-MoE checkpoint saved by transformers (2 layers, 8 experts, top-2, hidden 256,
   expert width 512) served with TP=2 and with TP=2 + expert parallelism, taking the same batch
   in turn (benchmarks/tensor_parallel.py's ``time_steps``): median prefill and decode step.
   Every engine here runs with async scheduling and prefix caching off (``TIMED``).
3. The built-in tiny-moe's decode step against two dense models: tiny-llama, the same shape with
   one MLP of 2 × 192 features (the same active parameters), and a random Llama of the same shape
   with one MLP of 8 × 192 features (the same total parameters, ``dense_twin``), at batch 1 and 8,
   the three engines taking the same batch in turn: median decode step and the ratios.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.tensor_parallel import time_steps
from engine import LLM
from engine.builtin_model import LLAMA_NAME, MOE_NAME, builtin_path, write_byte_tokenizer
from kernels import fused_moe_ref

# every engine here: one step() is one whole step (async scheduling would return before it ran), and each
# repetition's prompts are computed again (the prefix cache would find them all but their last token)
TIMED = dict(async_scheduling=False, enable_prefix_caching=False)


def per_expert_loop(x, w13, w2, topk_weights, topk_ids):
    out = torch.zeros_like(x)
    for e in topk_ids.unique().tolist():
        tok, k = torch.where(topk_ids == e)
        gate, up = (x[tok] @ w13[e].T).chunk(2, dim=-1)
        out.index_add_(0, tok, (F.silu(gate) * up) @ w2[e].T * topk_weights[tok, k, None])
    return out


def layer_ratio(num_tokens: int, reps: int, E=8, top_k=2, H=512, inter=1024) -> tuple[float, float]:
    """(reference ms, loop ms), medians over interleaved calls."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(num_tokens, H, generator=g)
    w13, w2 = torch.randn(E, 2 * inter, H, generator=g), torch.randn(E, H, inter, generator=g)
    w, ids = torch.softmax(torch.randn(num_tokens, E, generator=g), -1).topk(top_k, dim=-1)
    times: dict[str, list[float]] = {"ref": [], "loop": []}
    with torch.inference_mode():
        for _ in range(reps * 5 + 2):
            for name, fn in (("ref", fused_moe_ref), ("loop", per_expert_loop)):
                t0 = time.perf_counter()
                fn(x, w13, w2, w, ids)
                times[name].append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times["ref"][2:]), statistics.median(times["loop"][2:])


def tiny_qwen3_moe(path: Path) -> str:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=257, hidden_size=256, intermediate_size=512, moe_intermediate_size=512,
                         num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=32,
                         num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=512)
    Qwen3MoeForCausalLM(cfg).save_pretrained(path)
    write_byte_tokenizer(path, 256)
    return str(path)


def dense_twin(path: Path) -> str:
    """A dense Llama of tiny-moe's shape whose one MLP has as many features as its 8 experts
    together (8 × 192): its total parameters, less the routers and Qwen3's q/k norms. Random
    weights, saved by transformers, with tiny-moe's tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    moe = builtin_path(MOE_NAME)
    c = json.loads((moe / "config.json").read_text())
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
                      intermediate_size=c["num_experts"] * c["moe_intermediate_size"],
                      num_hidden_layers=c["num_hidden_layers"], num_attention_heads=c["num_attention_heads"],
                      num_key_value_heads=c["num_key_value_heads"], head_dim=c["head_dim"],
                      max_position_embeddings=c["max_position_embeddings"], rms_norm_eps=c["rms_norm_eps"],
                      tie_word_embeddings=False, bos_token_id=c["bos_token_id"], eos_token_id=c["eos_token_id"])
    LlamaForCausalLM(cfg).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(moe / name, path / name)
    return str(path)


def active_parameters(llm) -> tuple[int, int]:
    """(parameters held, parameters a token runs through) of an in-process engine's model."""
    from engine.model_executor.layers.fused_moe.layer import moe_layers

    model = llm.llm_engine.engine_core.engine_core.model
    total = sum(p.numel() for p in model.parameters())
    idle = sum((m.num_experts - m.top_k) * (m.w13_weight[0].numel() + m.w2_weight[0].numel())
               for _, m in moe_layers(model))
    return total, total - idle


def dense_comparison(path: str, reps: int, batches=(1, 8), decode_steps: int = 8) -> tuple[dict, dict]:
    """({(model, batch): median decode step ms}, {model: (parameters held, active)}): tiny-moe, the
    dense model of its active size and the dense model of its total size, the same batch in turn."""
    llms = {name: LLM(model, num_kv_blocks=128, **TIMED)
            for name, model in (("tiny-moe", MOE_NAME), ("same active", LLAMA_NAME), ("same total", path))}
    times: dict[tuple[str, int], list[float]] = {(k, b): [] for k in llms for b in batches}
    for rep in range(reps + 1):  # the first round warms up
        for b in batches:
            for name, llm in llms.items():
                r = time_steps(llm.llm_engine, b, 16, decode_steps, tag=f"{rep}-{b}-")
                if rep:
                    times[name, b] += r["decode_ms"]
    return {k: statistics.median(v) for k, v in times.items()}, {k: active_parameters(v) for k, v in llms.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--decode-steps", type=int, default=8)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    print("fused_moe_ref ÷ per-expert loop (one layer: E=8, top-2, hidden 512, expert width 1024)")
    for t in (8, 256):
        ref, loop = layer_ratio(t, args.reps)
        print(f"  T={t:4d}: reference {ref:7.2f} ms, loop {loop:7.2f} ms, ratio {ref / loop:.2f}")
    path = tiny_qwen3_moe(Path(tempfile.mkdtemp()))
    llms = {"TP=2": LLM(path, tensor_parallel_size=2, **TIMED),
            "TP=2 EP": LLM(path, tensor_parallel_size=2, enable_expert_parallel=True, **TIMED)}
    engines = {k: llm.llm_engine for k, llm in llms.items()}
    results: dict[str, dict[str, list[float]]] = {k: {"prefill": [], "decode": []} for k in engines}
    for rep in range(args.reps + 1):  # the first round warms up
        for name, engine in engines.items():
            r = time_steps(engine, args.requests, args.prompt_tokens, args.decode_steps, tag=f"{rep}{name}")
            if rep:
                results[name]["prefill"].append(r["prefill_ms"])
                results[name]["decode"].extend(r["decode_ms"])
    print(f"Qwen3-MoE (random, 2 layers, 8 experts, top-2), {args.requests} requests x {args.prompt_tokens} tokens")
    med = {k: {s: statistics.median(v) for s, v in r.items()} for k, r in results.items()}
    for stage in ("prefill", "decode"):
        tp, ep = med["TP=2"][stage], med["TP=2 EP"][stage]
        print(f"  {stage:7s} step: TP=2 {tp:7.2f} ms, TP=2 EP {ep:7.2f} ms, EP ÷ TP {ep / tp:.2f}")
    for llm in llms.values():
        llm.shutdown()
    med, params = dense_comparison(dense_twin(Path(tempfile.mkdtemp())), args.reps)
    print("decode step: tiny-moe against dense models of its active and its total size")
    for k, (held, active) in params.items():
        print(f"  {k}: {held:,} parameters held, {active:,} active")
    for b in sorted({b for _, b in med}):
        row = ", ".join(f"{k} {med[k, b]:6.2f} ms" for k in params)
        print(f"  batch {b}: {row}; tiny-moe ÷ same active {med['tiny-moe', b] / med['same active', b]:.2f}, "
              f"÷ same total {med['tiny-moe', b] / med['same total', b]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
