"""Engine flags shared by `generate` and `serve`, with vLLM's names."""
from __future__ import annotations

import argparse


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine", "model, KV cache and scheduler (vLLM's flag names)")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block (power of two; default 16)")
    g.add_argument(
        "--num-kv-blocks", type=int, default=None, help="exact number of KV-cache blocks (overrides --kv-cache-memory)"
    )
    g.add_argument("--kv-cache-memory", type=int, default=None, help="bytes for the KV cache (CPU default 256 MiB)")
    g.add_argument("--max-num-seqs", type=int, default=64, help="most requests running at once (default 64)")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget of one step (default 2048)")
    g.add_argument("--max-model-len", type=int, default=None, help="context length limit (default: the model's)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse KV blocks of shared prompt prefixes (default on)")
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                   help="split long prompts across steps (default on)")
    g.add_argument("--attention-backend", choices=["torch", "triton"], default=None,
                   help="paged-attention implementation (default: triton on CUDA, torch on CPU)")
    g.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None,
                   help="weights and KV cache (default: float32 on CPU, float16 on CUDA)")
    g.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    g.add_argument("--seed", type=int, default=0, help="engine seed for unseeded sampling (default 0)")
    par = parser.add_argument_group("tensor parallelism", "split every layer over N worker processes (gloo on the "
                                    "CPU, NCCL on CUDA); see lessons/18_tensor_parallelism.py")
    par.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                     help="ranks, one worker process each; must divide the model's attention heads (default 1: "
                          "no workers, the model runs in the engine core)")
    par.add_argument("--distributed-init-method", default=None, metavar="URL",
                     help="where the ranks meet: tcp://HOST:PORT, or env:// with MASTER_ADDR and MASTER_PORT set "
                          "(default: a free loopback port; several machines are not tested here)")
    par.add_argument("--distributed-timeout", type=float, default=30.0, metavar="S",
                     help="seconds a collective waits for a missing rank before the step fails (default 30; "
                          "torch's own default is 30 minutes)")


def llm_kwargs(args: argparse.Namespace) -> dict:
    return dict(block_size=args.block_size, num_kv_blocks=args.num_kv_blocks, kv_cache_memory=args.kv_cache_memory,
                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                max_model_len=args.max_model_len, enable_prefix_caching=args.enable_prefix_caching,
                enable_chunked_prefill=args.enable_chunked_prefill, attention_backend=args.attention_backend,
                dtype=args.dtype, device=args.device, seed=args.seed, tensor_parallel_size=args.tensor_parallel_size,
                distributed_init_method=args.distributed_init_method, distributed_timeout_s=args.distributed_timeout)
