"""Synthetic tensor-parallel traces, built as the engine emits them with tensor parallelism
(config.parallel, every rank's launches with `rank`, all_reduce / all_gather as launches,
the workers' startup stages and execute_model per step), for the fold and the panels' tests.

Rank r's launches take (r + 1) times rank 0's, so per-rank sums tell the ranks apart.
"""
from __future__ import annotations

import orjson

from engine.hooks import BEGIN, END, INSTANT
from tracer.events import Event, make_header

N_HEAD, N_LAYER, HIDDEN = 4, 2, 128
ATTN_NS, CACHE_NS, REDUCE_NS, GATHER_NS = 400_000, 100_000, 2_000_000, 300_000
WEIGHT_BYTES, PARAMS, KV_BYTES_PER_BLOCK, NUM_BLOCKS = 5_000_000, 1_000_000, 8192, 64


class _Trace:
    def __init__(self):
        self.events: list[Event] = []
        self.ts = 0

    def add(self, layer, name, kind=INSTANT, step=None, request_id=None, **attrs):
        self.ts += 1000
        self.events.append(Event(len(self.events), self.ts, layer, name, kind, request_id, step, attrs or None))


def shard(rank: int, n: int, size: int) -> list[int]:
    return [rank * size // n, (rank + 1) * size // n]


def tp_events(n: int = 2, steps: int = 1, with_rank: bool = True) -> list[Event]:
    """A whole run on n ranks: startup, one request, `steps` decode-sized steps. n=1 with
    with_rank=False is an old trace (no parallel config, no rank on the launches)."""
    t = _Trace()
    parallel = {"tensor_parallel_size": n, "distributed_executor_backend": "mp" if n > 1 else "uni",
                "distributed_init_method": None, "distributed_timeout_s": 30.0}
    config = {"model": {"model": "tiny-gpt2", "device": "cpu"}, "attention_backend": "torch",
              "cache": {"block_size": 4, "enable_prefix_caching": True}}
    if with_rank:
        config["parallel"] = parallel
    t.add("engine", "config", config=config, model="tiny-gpt2")
    t.add("engine", "model_load", BEGIN, path="tiny-gpt2", device="cpu", attention_backend="torch")
    if n > 1:
        for r in range(n):
            t.add("worker", "model_load", BEGIN, rank=r, world_size=n, pid=1000 + r)
            t.add("worker", "model_load", END, ok=True, rank=r, world_size=n, pid=1000 + r, seconds=0.02 * (r + 1),
                  bytes=WEIGHT_BYTES, params=PARAMS, heads=shard(r, n, N_HEAD), mlp=shard(r, n, 4 * HIDDEN),
                  vocab=shard(r, n, 4096), torch_threads=1)
    t.add("engine", "model_load", END, seconds=0.5, ok=True, bytes=WEIGHT_BYTES * n, params=PARAMS * n,
          **({"tensor_parallel_size": n} if n > 1 else {}))
    t.add("engine", "kv_cache_alloc", BEGIN)
    ranks = []
    for r in range(n if n > 1 else 0):
        kv = dict(num_blocks=NUM_BLOCKS, block_size=4, bytes=NUM_BLOCKS * KV_BYTES_PER_BLOCK,
                  bytes_per_block=KV_BYTES_PER_BLOCK, heads=shard(r, n, N_HEAD))
        t.add("worker", "kv_cache_alloc", BEGIN, rank=r, world_size=n, pid=1000 + r)
        t.add("worker", "kv_cache_alloc", END, ok=True, rank=r, world_size=n, pid=1000 + r, seconds=0.01, **kv)
        t.add("worker", "ready", rank=r, world_size=n, pid=1000 + r)
        ranks.append({"rank": r, "heads": kv["heads"], "bytes": kv["bytes"], "bytes_per_block": KV_BYTES_PER_BLOCK})
    extra = {"tensor_parallel_size": n, "ranks": ranks} if n > 1 else {}
    t.add("engine", "kv_cache_alloc", END, seconds=0.1, ok=True, num_blocks=NUM_BLOCKS, block_size=4,
          bytes=NUM_BLOCKS * KV_BYTES_PER_BLOCK * n, bytes_per_block=KV_BYTES_PER_BLOCK * n, reason="test", **extra)
    t.add("engine", "QUEUED", step=0, request_id="a", num_prompt_tokens=3, max_tokens=8)
    for step in range(steps):
        t.add("engine", "step", BEGIN, step=step)
        for r in range(n if n > 1 else 0):
            t.add("worker", "execute_model", step=step, rank=r, num_scheduled_tokens={"a": 1},
                  total_num_scheduled_tokens=1, finished_req_ids=[], digest=f"d{step:04x}", pid=1000 + r)
        for layer in range(N_LAYER):
            for r in range(n):
                rank = {"rank": r, "pid": 1000 + r} if with_rank else {}
                t.add("kernel", "reshape_and_cache_ref", step=step, layer_idx=layer, grid=[], meta={},
                      args={"key": [[1, N_HEAD // n, 32], "float32"]}, duration_ns=CACHE_NS * (r + 1),
                      timing="wall_clock", reason="reference", **rank)
                t.add("kernel", "unified_attention_ref", step=step, layer_idx=layer, grid=[], meta={},
                      args={"query": [[1, N_HEAD // n, 32], "float32"]}, duration_ns=ATTN_NS * (r + 1),
                      timing="wall_clock", reason="reference", **rank)
                for site in ("attn.c_proj", "mlp.c_proj") if n > 1 else ():
                    t.add("kernel", "all_reduce", step=step, layer_idx=layer, grid=[], duration_ns=REDUCE_NS * (r + 1),
                          timing="wall_clock", reason=f"row-parallel {site}", args={"tensor": [[1, HIDDEN], "float32"]},
                          meta={"op": "sum", "world_size": n, "bytes": HIDDEN * 4, "site": site, "group": "fast"},
                          **rank)
        for r in range(n if n > 1 else 0):
            t.add("kernel", "all_gather", step=step, layer_idx=None, grid=[], duration_ns=GATHER_NS * (r + 1),
                  timing="wall_clock", reason="lm_head", args={"tensor": [[1, 4096 // n], "float32"]}, rank=r,
                  meta={"op": "all_gather", "world_size": n, "bytes": 4096 // n * 4, "site": "lm_head",
                        "group": "fast"})
        t.add("engine", "step", END, step=step, stats={"num_free_blocks": NUM_BLOCKS - 1,
                                                      "num_total_blocks": NUM_BLOCKS})
    return t.events


def rank_ns(r: int, n: int = 2) -> tuple[int, int]:
    """(all of rank r's kernel time in a step, its communication time) as tp_events makes them."""
    comm = (N_LAYER * 2 * REDUCE_NS + GATHER_NS) * (r + 1)
    return N_LAYER * (CACHE_NS + ATTN_NS) * (r + 1) + comm, comm


def write_trace(path, events: list[Event]):
    """A trace file of these events (what `vllm-trace replay` and `export` read)."""
    with open(path, "wb") as f:
        f.write(orjson.dumps(make_header("tiny-gpt2", start_perf_ns=0)) + b"\n")
        for ev in events:
            f.write(ev.to_json_line())
    return path
