"""Lesson 20: what grouped-query attention does to the KV cache — and where RoPE is applied."""
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # `python lessons/NN_x.py` from a checkout

import torch

from engine import SamplingParams
from engine.trace_names import is_attention_kernel
from lessons.cli import main
from lessons.framework import events_of, greedy, queue_request, table

TITLE = "What GQA does to the KV cache"
SUMMARY = ("tiny-gpt2 (multi-head attention) beside tiny-llama (8 query heads sharing 2 KV heads): bytes of KV "
           "per token, how many more requests fit in the same memory (measured with the scheduler), and where "
           "RoPE rotates the keys relative to the cache write (checked on the cached keys).")
BLOCK = 16
MHA, GQA = "tiny-gpt2", "tiny-llama"
PROMPT = "The paged KV cache stores the keys and values of every token in fixed-size blocks."


def run(lesson) -> None:
    lesson.intro(
        "Every token a request has seen keeps its keys and values in the KV cache, in every layer. With "
        "**multi-head attention** (GPT-2) each query head has its own K and V head. **Grouped-query attention** "
        "(Llama 2 70B, Llama 3, Qwen3, Mistral) lets a group of query heads share one K/V head: the model still "
        "asks 8 questions per token, but caches only 2 heads' keys and values. The two built-in models here are "
        "both 4 layers × 128 wide on the same tokenizer; they differ in attention.")
    budget_blocks = 40  # of the MHA model's blocks: the same bytes for both
    engines = _start_both_models(lesson, budget_blocks)
    group = _gqa_caches_fewer_bytes_per_token(lesson, engines, budget_blocks)
    lesson.pause()

    # ---- how many more requests fit ----
    _more_requests_fit(lesson, engines, group)
    lesson.pause()

    # ---- RoPE and the cache write ----
    llm, session, core = engines[GQA]
    ids, req = _rope_runs_before_the_cache_write(lesson, llm, session, core)
    _cache_holds_rotated_keys(lesson, llm, core, ids, list(req.block_ids))
    lesson.done(
        f"GQA caches only the KV heads: {group}× fewer bytes per token here, so {group}× the blocks and at least "
        f"{group}× the concurrent requests in the same memory; the attention kernel maps query head h to KV head "
        f"h // {group}. RoPE rotates q and k in every layer before the cache write, so cached keys already carry "
        "their positions and are never rotated again.")


def _start_both_models(lesson, budget_blocks: int) -> dict:
    """One engine per model, each given the same KV-cache bytes: name -> (llm, session, engine core)."""
    engines = {}
    for name in (MHA, GQA):
        llm, session = lesson.engine(model=name, block_size=BLOCK, enable_prefix_caching=False,
                                     kv_cache_memory=budget_blocks * _mha_block_bytes(), max_num_seqs=256,
                                     max_num_batched_tokens=4096)
        engines[name] = (llm, session, llm.llm_engine.engine_core.engine_core)
    return engines


def _gqa_caches_fewer_bytes_per_token(lesson, engines: dict, budget_blocks: int) -> int:
    """The cache shapes and bytes per token of both models; returns GQA's group factor."""
    rows, per_token = [], {}
    for name, (_, _, core) in engines.items():
        cfg, k = core.model_config, core.kv_caches[0][0]
        alloc = next(info for stage, _, info in core.startup if stage == "kv_cache_alloc")
        per_token[name] = alloc["bytes_per_block"] // BLOCK
        rows.append([f"{name} ({cfg.architecture})", cfg.num_heads, cfg.num_kv_heads, cfg.head_size,
                     "×".join(map(str, k.shape)), f"{per_token[name]:,}", alloc["num_blocks"]])
    lesson.show(table(["model", "query heads", "KV heads", "head size", "a layer's K cache", "KV bytes / token",
                       "blocks"], rows,
                      title=f"the same KV-cache memory ({budget_blocks * _mha_block_bytes():,} bytes) for both"))
    mha, gqa = engines[MHA][2], engines[GQA][2]
    group = gqa.model_config.num_heads // gqa.model_config.num_kv_heads
    lesson.check(gqa.kv_caches[0][0].shape[2] == gqa.model_config.num_kv_heads == 2,
                 "tiny-llama's cache tensors hold 2 KV heads per token, not its 8 query heads")
    lesson.check(per_token[MHA] == 2 * 4 * 4 * 32 * 4 and per_token[MHA] == group * per_token[GQA],
                 f"bytes per token = 2 (K, V) × 4 layers × KV heads × head size × 4 bytes: "
                 f"{per_token[MHA]:,} with 4 heads × 32 dims, {per_token[GQA]:,} with 2 KV heads × 16 dims: "
                 f"smaller by the group factor {group} (8 query heads / 2 KV heads)")
    n_gqa, n_mha = (c.kv_cache_manager.block_pool.num_gpu_blocks for c in (gqa, mha))
    lesson.check(n_gqa == group * n_mha, f"so the same memory holds {group}× the blocks: {n_gqa} against {n_mha}")
    return group


def _more_requests_fit(lesson, engines: dict, group: int) -> None:
    """The same burst of 48 requests on both engines: how many the first step admits."""
    lesson.say("**How many more requests fit.** The same burst on both engines: 48 copies of a 63-token prompt "
               "(4 blocks each with the 64th token; prefix caching off, so none share), two tokens each. The "
               "scheduler admits waiting requests while the KV-cache manager can give each its blocks; the rest wait.")
    running = {}
    for name, (llm, _, core) in engines.items():
        engine = llm.llm_engine
        for i in range(48):
            engine.add_request(f"r{i}", {"prompt_token_ids": list(range(1, 64))},
                               SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
        engine.step()  # one schedule: every admitted prompt is prefilled in this step
        running[name] = (len(core.scheduler.running), len(core.scheduler.waiting),
                         core.kv_cache_manager.num_usable_blocks)
        while engine.has_unfinished_requests():
            engine.step()
    lesson.show(table(["model", "usable blocks", "prefilled in the first step", "left waiting"],
                      [[n, b, r, w] for n, (r, w, b) in running.items()],
                      title="48 requests of 4 blocks each, first step"))
    (r_mha, _, b_mha), (r_gqa, _, b_gqa) = running[MHA], running[GQA]
    lesson.check(r_mha == b_mha // 4 and r_gqa == min(48, b_gqa // 4),
                 f"each engine ran as many as its blocks allow: {b_mha} // 4 = {r_mha} and "
                 f"{b_gqa} // 4 = {r_gqa} (block 0 is the null block, never handed out)")
    lesson.check(r_gqa >= group * r_mha,
                 f"GQA fits {r_gqa / r_mha:.1f}× the requests in the same memory (at least the group factor {group})")


def _rope_runs_before_the_cache_write(lesson, llm, session, core):
    """Prefill one prompt on the GQA model and show layer 0's launch order; returns the prompt ids and request."""
    lesson.say("**Where RoPE is applied.** GPT-2 adds a learned position vector to the token embedding at the "
               "bottom of the model. Llama has no position table: in every layer, *rotary embedding* rotates each "
               "query and key head by an angle proportional to the token's position, and it does so **before** "
               "the key is written to the cache. So the cache holds rotated keys; a later decode step reads them "
               "as they are and rotates only its own new query and key.")
    ids = llm.get_tokenizer().encode(PROMPT)
    req = queue_request(llm.llm_engine, "rope", {"prompt_token_ids": ids}, greedy(3))
    llm.llm_engine.step()  # the prefill
    batch = next(e for e in reversed(events_of(session)) if e.layer == "model_runner" and e.name == "batch")
    step = batch.step
    launches = [e for e in events_of(session) if e.layer == "kernel" and e.step == step
                and e.attrs.get("layer_idx") == 0]
    order = [e.name for e in launches]
    lesson.show(table(["#", "launch in layer 0, prefill step"], [[i, n] for i, n in enumerate(order)]))
    attention = next(i for i, n in enumerate(order) if is_attention_kernel(n))  # (whichever backend's)
    lesson.check(order.index("rotary_embedding") < order.index("reshape_and_cache_ref") < attention,
                 "in each layer the rotary embedding runs before the cache write, which runs before attention")
    lesson.check(batch.attrs["rope"]["theta"] == core.model_config.rope_theta and batch.attrs["positions"] ==
                 list(range(len(ids))), f"the model runner's batch event carries the positions the rotation uses "
                 f"(0..{len(ids) - 1}) and the RoPE base θ = {core.model_config.rope_theta:g}")
    return ids, req


def _cache_holds_rotated_keys(lesson, llm, core, ids: list[int], blocks: list[int]) -> None:
    """Layer 0's cached keys against k_proj(x) by hand, rotated and not; a decode step leaves them as they are."""
    # Recompute layer 0's keys from the prompt by hand: embedding -> RMSNorm -> k_proj (no position anywhere yet).
    model, attn = core.model, core.model.model.layers[0].self_attn
    with torch.inference_mode():
        x = model.model.layers[0].input_layernorm(model.model.embed_tokens(torch.tensor(ids)))
        _, k_raw, _ = attn.qkv_proj(x).split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        k_raw = k_raw.view(len(ids), attn.num_kv_heads, attn.head_dim)
        _, k_rot = attn.rotary_emb.forward_native(torch.arange(len(ids)), k_raw, k_raw)
    cached = _cached_keys(core, blocks, len(ids))
    err_rot, err_raw = (cached - k_rot).abs().max().item(), (cached[1:] - k_raw[1:]).abs().max().item()
    err_0 = (cached[0] - k_raw[0]).abs().max().item()
    lesson.show(table(["cached keys of layer 0 vs", "max |difference|"],
                      [["k_proj(x), rotated by RoPE at each token's position", f"{err_rot:.2e}"],
                       ["k_proj(x), not rotated (positions 1..)", f"{err_raw:.2e}"],
                       ["at position 0 (rotation by angle 0), not rotated", f"{err_0:.2e}"]]))
    lesson.check(err_rot < 1e-5 and err_raw > 1e-2,
                 "the cache holds the *rotated* keys: equal to RoPE(k) to float precision, far from the raw k")
    lesson.check(err_0 < 1e-6,
                 "position 0 is rotated by angle 0: its cached key is the raw one")
    llm.llm_engine.step()  # a decode step: one new token at position len(ids)
    lesson.check(torch.equal(_cached_keys(core, blocks, len(ids)), cached),
                 "after a decode step the prompt's cached keys are bit for bit the same: they are not rotated again")
    while llm.llm_engine.has_unfinished_requests():
        llm.llm_engine.step()


def _mha_block_bytes() -> int:
    return 2 * 4 * BLOCK * 4 * 32 * 4  # tiny-gpt2: K and V × 4 layers × 16 tokens × 4 heads × 32 dims × 4 bytes


def _cached_keys(core, blocks: list[int], n: int) -> torch.Tensor:
    """Layer 0's cached keys of positions 0..n-1, read through the block table: [n, KV heads, head size]."""
    cache = core.kv_caches[0][0]
    return torch.stack([cache[blocks[p // BLOCK], p % BLOCK] for p in range(n)]).clone()


if __name__ == "__main__":
    sys.exit(main(globals()))
