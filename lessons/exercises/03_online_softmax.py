"""Exercise 3: one program's online softmax over paged K/V (lesson 7).

Graded inside the engine: the attention backend is replaced by one that writes the step's K/V
into the cache as usual, then computes every query row and head with the learner's function.
"""
from __future__ import annotations

import torch

from engine import LLM
from kernels.reference import reshape_and_cache_ref
from lessons.exercises import Grader, greedy, learner_call, run_to_end

TITLE = "Online softmax over paged K/V"
SUMMARY = "online softmax over one request's paged K/V, tile by tile"
FUNCTION = "attend_one_row"
IMPORTS = "import torch"
SIGNATURE = ("def attend_one_row(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, head: int,\n"
             "                   block_table: list[int], context_len: int, scale: float,\n"
             "                   tile: int = 16) -> torch.Tensor:")
CONTRACT = """
Paged attention for one query token and one head, by online softmax, tile by tile.

q: [head_size], the token's query for this head (float32).
key_cache, value_cache: [num_blocks, block_size, num_heads, head_size], one layer's paged cache.
The token attends to its request's keys at positions 0 .. context_len - 1 (its own included);
position p lives in physical block block_table[p // block_size], slot p % block_size.
Return softmax(scores) @ V over those keys, a [head_size] float32 tensor, where
scores = (K @ q) * scale, computed over tiles of `tile` positions: keep a running max m, a
running sum l of exp(s - m) and a running acc = sum of exp(s - m) * v; when a tile raises the
max, rescale l and acc by exp(m_old - m_new) first. At the end return acc / l.

Read only those keys: other blocks, and slots past context_len, hold other requests' data (or
nothing), and block_table may be padded with 0 (the null block) past the request's own blocks.
Scores can be large: exp of a raw score may overflow float32, which is what m is for.
"""
SOLUTION_BODY = """
block_size = key_cache.shape[1]
m = torch.tensor(float("-inf"))
l = torch.tensor(0.0)
acc = torch.zeros(q.shape[-1])
for t in range(0, context_len, tile):
    pos = torch.arange(t, min(t + tile, context_len))
    blocks = torch.tensor(block_table)[pos // block_size]
    k = key_cache[blocks, pos % block_size, head].float()
    v = value_cache[blocks, pos % block_size, head].float()
    s = (k @ q.float()) * scale
    m_new = torch.maximum(m, s.max())
    alpha = torch.exp(m - m_new)
    p = torch.exp(s - m_new)
    l = l * alpha + p.sum()
    acc = acc * alpha + p @ v
    m = m_new
return acc / l
"""
BLOCK = 16


def exact(q, key_cache, value_cache, head, table, n, scale) -> torch.Tensor:
    pos = torch.arange(n)
    blocks = torch.tensor(table)[pos // key_cache.shape[1]]
    k = key_cache[blocks, pos % key_cache.shape[1], head].double()
    v = value_cache[blocks, pos % key_cache.shape[1], head].double()
    return (torch.softmax((k @ q.double()) * scale, 0) @ v).float()


def call(fn, q, kc, vc, head, table, n, scale, **kw) -> torch.Tensor:
    out = learner_call(fn, q.clone(), kc, vc, head, list(table), n, scale, **kw)
    return out if isinstance(out, torch.Tensor) else torch.as_tensor(out)


def diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max()) if a.shape == b.shape else float("inf")


def by_hand(fn, g: Grader) -> None:
    gen = torch.Generator().manual_seed(0)
    num_blocks, heads, hs = 10, 2, 8
    kc = torch.randn(num_blocks, BLOCK, heads, hs, generator=gen)
    vc = torch.randn(num_blocks, BLOCK, heads, hs, generator=gen)
    q = torch.randn(hs, generator=gen)
    table, n, scale = [7, 2, 5, 0, 0], 40, hs ** -0.5  # 3 real blocks (the last one part-full), padded with 0
    out = call(fn, q, kc, vc, 1, table, n, scale)
    want = exact(q, kc, vc, 1, table, n, scale)
    g.check(out.shape == (hs,), f"it returns a [head_size] = [{hs}] tensor", f"got shape {tuple(out.shape)}")
    g.check(diff(out, want) < 1e-5, "it equals softmax(q·K × scale)·V over the 40 keys found through the "
            "block table [7, 2, 5] (to 1e-5)", f"max |difference| {diff(out, want):.3g}")
    poisoned_k, poisoned_v = kc.clone(), vc.clone()
    mine = torch.zeros(num_blocks, BLOCK, dtype=torch.bool)
    for p in range(n):
        mine[table[p // BLOCK], p % BLOCK] = True
    poisoned_k[~mine], poisoned_v[~mine] = float("nan"), float("nan")
    out = call(fn, q, poisoned_k, poisoned_v, 1, table, n, scale)
    g.check(bool(torch.isfinite(out).all()) and diff(out, want) < 1e-5,
            "it reads only its request's blocks, and only positions < context_len (everything else set to NaN "
            "here changes nothing)", "NaN came through: it read a slot outside the request's first 40 positions "
            "(another block, the null-block padding, or the empty end of the last block)")
    hot = 400 * scale  # scores in the hundreds: exp() of a raw score overflows float32 above ~88.7
    out = call(fn, q, kc, vc, 1, table, n, hot)
    want_hot = exact(q, kc, vc, 1, table, n, hot)
    g.check(bool(torch.isfinite(out).all()) and diff(out, want_hot) < 1e-4,
            "with scores in the hundreds (exp overflows float32) the result is still right: the running max "
            "keeps every exp in range", f"got {out[:4].tolist()}…, expected {want_hot[:4].tolist()}…")
    outs = {t: call(fn, q, kc, vc, 0, table, n, scale, tile=t) for t in (5, 16, 64)}
    want0 = exact(q, kc, vc, 0, table, n, scale)
    g.check(all(diff(o, want0) < 1e-5 for o in outs.values()),
            "tiles of 5, 16 or 64 keys give the same answer: the rescaling loses nothing",
            ", ".join(f"tile {t}: max |difference| {diff(o, want0):.3g}" for t, o in outs.items()))


def run_workload(engine) -> dict[str, list[int]]:
    engine.add_request("A", {"prompt_token_ids": [(3 * i + 1) % 250 for i in range(20)]}, greedy(6))
    engine.step()
    engine.add_request("B", {"prompt_token_ids": [(7 * i) % 250 for i in range(12)]}, greedy(6))
    return run_to_end(engine)


def grade(fn, g: Grader, model: str = "tiny-gpt2") -> None:
    by_hand(fn, g)
    g.say("Now inside a real engine: every query row and head of every layer is your function's.")
    kw = dict(block_size=BLOCK, num_kv_blocks=16, enable_prefix_caching=False, async_scheduling=False)
    engine = LLM(model, **kw).llm_engine
    core = engine.engine_core.engine_core  # the EngineCore behind the InprocClient
    reference, worst, calls = core.model.backend.forward, [0.0, ""], [0]

    def forward(q, k, v, key_cache, value_cache, meta, scale):
        reshape_and_cache_ref(k, v, key_cache, value_cache, meta.slot_mapping)
        qsl, seq_lens, tables = meta.query_start_loc.tolist(), meta.seq_lens.tolist(), meta.block_tables.tolist()
        out = torch.empty_like(q)
        for i in range(len(seq_lens)):
            for row in range(qsl[i], qsl[i + 1]):
                context = seq_lens[i] - (qsl[i + 1] - row) + 1  # its position + 1: causal
                for h in range(q.shape[1]):
                    out[row, h] = call(fn, q[row, h].float(), key_cache, value_cache, h, tables[i], context,
                                       scale).to(q.dtype)
                    calls[0] += 1
        want = reference(q, k, v, key_cache, value_cache, meta, scale)  # rewrites the same slots: harmless
        d = diff(out, want)
        if d > worst[0]:
            worst[:] = [d, f"step {core.step_count}: seq_lens {seq_lens}, max |difference| {d:.3g}"]
        return out

    core.model.backend.forward = forward
    outputs = run_workload(engine)
    g.check(worst[0] < 1e-4, f"in every layer of every step, your {calls[0]} row-head results match the engine's "
            "attention (to 1e-4)", worst[1])
    ref = run_workload(LLM(model, **kw).llm_engine)
    bad = [r for r in ref if outputs.get(r) != ref[r]]
    g.check(not bad, "A's and B's greedy output (prefill, then decodes over paged K/V) is token for token the "
            "engine's own", f"{bad} differ")
