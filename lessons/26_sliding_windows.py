"""Lesson 26: sliding windows and the hybrid KV cache — blocks that a window has passed go back to the pool."""
import json
import pathlib
import shutil
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # `python lessons/NN_x.py` from a checkout

from lessons.cli import main
from lessons.framework import greedy, queue_request, table

TITLE = "Sliding windows and the hybrid KV cache"
SUMMARY = ("A Gemma-3-shaped model (five sliding-window layers to one global): its KV-cache groups over one block "
           "pool, a long request's window blocks recycled step by step (the null block where the window passed), "
           "the requests that fit against full attention (measured with the scheduler), and why a prefix hit "
           "needs only the window.")
WINDOW, BLOCK = 16, 4
PROMPT = "A sliding window keeps only the recent past: older keys and values are never read again. "


def make_checkpoint(folder: pathlib.Path) -> tuple[str, str]:
    """A random Gemma-3-shaped checkpoint saved by transformers, and the same weights with full attention on
    every layer (its config only differs). Random weights: its text is noise, its cache behaves as a real one."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    from transformers.utils import logging as hf_logging

    from engine.builtin_model import write_byte_tokenizer

    hf_logging.disable_progress_bar()  # (its "Writing model shards" bar, in the middle of the lesson)
    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=257, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                           sliding_window=WINDOW, layer_types=["sliding_attention"] * 5 + ["full_attention"],
                           bos_token_id=256, eos_token_id=256, pad_token_id=0, query_pre_attn_scalar=16)
    hybrid, full = folder / "gemma3-shaped", folder / "full-attention"
    Gemma3ForCausalLM(cfg).save_pretrained(hybrid)
    write_byte_tokenizer(hybrid, 256)
    shutil.copytree(hybrid, full)
    conf = json.loads((full / "config.json").read_text())
    conf.update(layer_types=["full_attention"] * 6, sliding_window=None)
    (full / "config.json").write_text(json.dumps(conf))
    return str(hybrid), str(full)


def run(lesson) -> None:
    lesson.intro(
        "Gemma 3 alternates **five sliding-window layers with one global layer**; gpt-oss alternates a "
        "128-token window with full attention; Mistral slides a window over every layer. A sliding-window "
        "layer's token at position p reads only positions p - window + 1 .. p, so the keys and values before "
        "the window are never read again. vLLM's **hybrid KV-cache manager** (`KVCacheCoordinator` over a "
        "`FullAttentionManager` and `SlidingWindowManager`s) puts the layers in **groups** by attention type, "
        "one block table per group, all drawing on **one block pool**, and gives a block back as soon as the "
        f"window has passed it. This lesson makes a small Gemma-3-shaped checkpoint (window {WINDOW} tokens, "
        f"blocks of {BLOCK}) and watches its cache.")
    with tempfile.TemporaryDirectory() as folder:
        hybrid, full = make_checkpoint(pathlib.Path(folder))
        groups(lesson, hybrid)
        window_step_by_step(lesson, hybrid)
        what_fits(lesson, hybrid, full)
        prefix_hit(lesson, hybrid)
    lesson.done(
        "A hybrid model's layers sit in KV-cache groups by attention type, each with its own block table per "
        "request, all over one block pool. A sliding-window group holds only the blocks its window can still "
        "read: the null block stands where the window has passed, and the freed blocks serve other requests, "
        "so many more long requests fit than with full attention everywhere. A prefix hit needs every full-"
        "attention block of the prefix, but only the window's blocks in a sliding group.")


def groups(lesson, path: str) -> None:
    llm, _ = lesson.engine(model=path, block_size=BLOCK, num_kv_blocks=256)
    bm = llm.llm_engine.engine_core.engine_core.kv_cache_manager
    rows = [[str(g), " ".join(map(str, spec.layer_ids)),
             f"sliding window {spec.kv_cache_spec.sliding_window}" if spec.kv_cache_spec.sliding_window
             else "full attention"] for g, spec in enumerate(bm.kv_cache_groups)]
    lesson.show(table(["group", "layers", "attention"], rows, title="the KV-cache groups, as the engine made them"))
    windows = [g.kv_cache_spec.sliding_window for g in bm.kv_cache_groups]
    lesson.check(len(bm.kv_cache_groups) == 6 and windows.count(WINDOW) == 5 and windows.count(None) == 1,
                 "six groups of one layer each: V1 cuts every attention type's layers into groups as large as the "
                 "smallest type's (one global layer), so a block holds the same bytes in every group and one pool "
                 "serves them all")
    lesson.pause()


def window_step_by_step(lesson, path: str) -> None:
    llm, _ = lesson.engine(model=path, block_size=BLOCK, num_kv_blocks=256)
    core = llm.llm_engine.engine_core.engine_core
    req = queue_request(llm.llm_engine, "long", PROMPT, greedy(24))
    sliding = [g for g, spec in enumerate(core.kv_cache_manager.kv_cache_groups) if spec.kv_cache_spec.sliding_window]
    full = next(g for g in range(len(core.kv_cache_manager.kv_cache_groups)) if g not in sliding)
    most = -(-(WINDOW - 1) // BLOCK) + 1  # the window's blocks, and one it straddles
    rows, held_ok, full_ok = [], True, True
    while llm.llm_engine.has_unfinished_requests():
        llm.llm_engine.step()
        if req.status.finished:
            break
        table_ = req.kv_block_ids[sliding[0]]
        live = [b for b in table_ if b]
        held_ok &= all(len([b for b in req.kv_block_ids[g] if b]) <= most for g in sliding)
        full_ok &= len(req.kv_block_ids[full]) == -(-req.num_computed_tokens // BLOCK)
        rows.append([req.num_computed_tokens, len(req.kv_block_ids[full]), len(table_) - len(live), len(live),
                     " ".join("∅" if not b else str(b) for b in table_[-8:])])
    lesson.show(table(["computed tokens", "full-attention blocks", "sliding: null", "sliding: held",
                       "sliding group 0's table (last 8)"], rows[::4] + rows[-1:],
                      title=f"request 'long' ({req.num_prompt_tokens}-token prompt), step by step"))
    lesson.check(held_ok and full_ok and rows[-1][2] > 0,
                 f"in every sliding-window group the request held at most {most} blocks at every step "
                 f"(ceil(({WINDOW} - 1) / {BLOCK}) + 1), with the null block in place of the "
                 f"{rows[-1][2]} blocks the window passed; its full-attention table grew to one block per "
                 f"{BLOCK} computed tokens")
    lesson.pause()


def _peak_running(path: str, lesson, num_kv_blocks: int) -> tuple[int, list]:
    llm, _ = lesson.engine(model=path, block_size=BLOCK, num_kv_blocks=num_kv_blocks, enable_prefix_caching=False)
    for i in range(12):
        queue_request(llm.llm_engine, f"r{i}", f"{i} " + PROMPT, greedy(16))
    peak, outs = 0, {}
    while llm.llm_engine.has_unfinished_requests():
        for out in llm.llm_engine.step():
            outs.setdefault(out.request_id, out)
        peak = max(peak, len(llm.llm_engine.engine_core.engine_core.scheduler.running))
    return peak, [outs[f"r{i}"].outputs[0].token_ids for i in range(12)]


def what_fits(lesson, hybrid: str, full: str) -> None:
    # the same bytes for both: a full-attention block holds all six layers, a hybrid one a group's one layer
    blocks = 60
    peak_full, _ = _peak_running(full, lesson, blocks)
    peak_hybrid, _ = _peak_running(hybrid, lesson, 6 * blocks)
    lesson.show(table(["", "full attention everywhere", "hybrid (5 sliding : 1 full)"],
                      [["cache", f"{blocks} blocks × 6 layers", f"{6 * blocks} blocks × 1 layer (same bytes)"],
                       ["requests running at once (peak)", peak_full, peak_hybrid]],
                      title=f"12 requests of {len(PROMPT) + 1} prompt tokens + 16, the same KV memory"))
    lesson.check(peak_hybrid > peak_full,
                 f"on the same memory the hybrid cache ran {peak_hybrid} requests at once against {peak_full} with "
                 "full attention: five layers in six keep only their window")
    lesson.pause()


def prefix_hit(lesson, path: str) -> None:
    llm, _ = lesson.engine(model=path, block_size=BLOCK, num_kv_blocks=256)
    first = queue_request(llm.llm_engine, "first", PROMPT + "one", greedy(2))
    while llm.llm_engine.has_unfinished_requests():
        llm.llm_engine.step()
    second = queue_request(llm.llm_engine, "second", PROMPT + "two", greedy(2))
    llm.llm_engine.step()  # admitted: its prefix found in the cache
    core = llm.llm_engine.engine_core.engine_core
    sliding = [g for g, spec in enumerate(core.kv_cache_manager.kv_cache_groups) if spec.kv_cache_spec.sliding_window]
    hit_blocks = second.num_cached_tokens // BLOCK
    in_window = [len([b for b in second.kv_block_ids[g][:hit_blocks] if b]) for g in sliding]
    most = -(-(WINDOW - 1) // BLOCK) + 1
    lesson.show(table(["request", "prompt tokens", "found in the prefix cache", "sliding group 0's hit blocks"],
                      [["first", first.num_prompt_tokens, 0, "-"],
                       ["second", second.num_prompt_tokens, second.num_cached_tokens,
                        " ".join("∅" if not b else str(b) for b in second.kv_block_ids[sliding[0]][:hit_blocks])]],
                      title="two prompts with a long common prefix"))
    lesson.check(second.num_cached_tokens > WINDOW and all(n <= most for n in in_window),
                 f"the second request found {second.num_cached_tokens} prefix tokens, yet in each sliding-window "
                 f"group it took at most {most} cached blocks (the window before its first new token); the rest "
                 "of the prefix is the null block there: a hit in a sliding group needs only the window")
    lesson.pause()


if __name__ == "__main__":
    raise SystemExit(main(globals()))
