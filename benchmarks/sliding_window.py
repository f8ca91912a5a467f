"""Sliding-window attention and the hybrid KV cache: memory and concurrency against full attention on
the same cache, and the Triton kernel's decode time with the window against without.

    python -m benchmarks.sliding_window [--window 32] [--block-size 16] [--requests 16] [--reps 5]

A random Gemma-3-shaped checkpoint saved by transformers (six layers: five sliding-window layers to
one global one, as Gemma 3), and the same checkpoint with no window (full attention on every layer),
each given the same KV-cache bytes. Every request has a 128-token prompt and generates 128 tokens.
Prints, for each, the KV bytes a request holds at its last step, the most requests that ran at
once and the number of preemptions. Then the attention kernel alone (interpreted Triton on a CPU:
its cost follows the tiles it runs): a decode batch of 8 requests with 512-token contexts, with
the window and without (the median of --reps).
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

from engine import LLM, SamplingParams
from engine.builtin_model import write_byte_tokenizer
from engine.core.block_pool import NULL_BLOCK_ID


def _checkpoint(path: Path, window: int) -> tuple[str, str]:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=257, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                           bos_token_id=256, eos_token_id=256, pad_token_id=0, sliding_window=window)
    Gemma3ForCausalLM(cfg).save_pretrained(path / "windowed")
    write_byte_tokenizer(path / "windowed", 256)
    shutil.copytree(path / "windowed", path / "full")
    raw = json.loads((path / "full" / "config.json").read_text())
    raw["sliding_window"] = None
    (path / "full" / "config.json").write_text(json.dumps(raw))
    return str(path / "windowed"), str(path / "full")


def run(path: str, memory: int, block_size: int, requests: int) -> dict:
    llm = LLM(path, dtype="float32", block_size=block_size, kv_cache_memory=memory, max_num_batched_tokens=512)
    engine = llm.llm_engine
    core = engine.engine_core.engine_core
    alloc = next(info for stage, _, info in core.startup if stage == "kv_cache_alloc")
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    for i in range(requests):
        engine.add_request(str(i), {"prompt_token_ids": [(7 * i + j) % 256 for j in range(128)]}, params)
    most, held = 0, []
    while engine.has_unfinished_requests():
        engine.step()
        most = max(most, len(core.scheduler.running))
        held += [sum(b != NULL_BLOCK_ID for g in r.kv_block_ids for b in g) for r in core.scheduler.running
                 if r.num_tokens >= 255]
    stats = core.stats()
    llm.shutdown()
    per_block = alloc["bytes_per_block"]
    return dict(num_blocks=alloc["num_blocks"], bytes_per_block=per_block, most_running=most,
                groups=len(alloc.get("kv_cache_groups", [0])), bytes_per_request=max(held) * per_block,
                preemptions=stats.num_preemptions)


def kernel_time(window: int | None, reps: int) -> float:
    from kernels import unified_attention

    g = torch.Generator().manual_seed(0)
    bs, n, ctx = 16, 8, 512
    blocks = n * ctx // bs
    k, v = (torch.randn(blocks + 1, bs, 2, 64, generator=g) for _ in range(2))
    tables = torch.arange(1, blocks + 1, dtype=torch.int32).view(n, ctx // bs)
    q = torch.randn(n, 8, 64, generator=g)
    qsl = torch.arange(n + 1, dtype=torch.int32)
    seq = torch.full((n,), ctx, dtype=torch.int32)
    times = []
    for _ in range(reps + 1):  # the first compiles
        t0 = time.perf_counter()
        unified_attention(q, k, v, qsl, seq, tables, 0.125, max_query_len=1, max_seq_len=ctx, sliding_window=window)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--window", type=int, default=32)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        windowed, full = _checkpoint(Path(tmp), args.window)
        memory = 64 * 6 * 2 * args.block_size * 2 * 16 * 4  # 64 blocks of the full-attention model
        for name, path in (("full attention", full), (f"window {args.window}", windowed)):
            r = run(path, memory, args.block_size, args.requests)
            print(f"{name:>15}: {r['groups']} group(s), {r['num_blocks']} blocks of {r['bytes_per_block']:,} B; "
                  f"a 256-token request holds {r['bytes_per_request']:,} B; at most {r['most_running']} running; "
                  f"{r['preemptions']} preemptions")
    full_t, win_t = kernel_time(None, args.reps), kernel_time(128, args.reps)
    print(f"decode attention, 8 x 512-token contexts: {full_t * 1e3:.1f} ms full, {win_t * 1e3:.1f} ms with a "
          f"128-token window ({full_t / win_t:.1f}x)")


if __name__ == "__main__":
    main()
