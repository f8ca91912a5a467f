"""Lesson 5: the paged KV cache — blocks, the free-block queue, block tables, fragmentation."""
import math
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # `python lessons/NN_x.py` from a checkout

from engine import SamplingParams
from lessons.cli import main
from lessons.framework import block_table, kv_blocks, queue_request, table

TITLE = "The paged KV cache"
SUMMARY = "Blocks, the free-block queue and block tables: logical -> physical, and the slots paging saves."
BLOCK = 16


def run(lesson) -> None:
    lesson.intro(
        "The KV cache is cut into fixed-size **blocks** of 16 token slots. A request owns a list of "
        "blocks — its **block table** — that maps its *logical* blocks (tokens 0–15, 16–31, …) to "
        "*physical* blocks anywhere in the cache. You will watch a real engine fill block tables step "
        "by step, and count the slots paging wastes against reserving memory up front.")
    llm, _ = lesson.engine(block_size=BLOCK, num_kv_blocks=64, enable_prefix_caching=False)
    engine = llm.llm_engine
    bm = engine.engine_core.engine_core.kv_cache_manager
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    free0 = bm.num_free_blocks
    _block_0_is_the_null_block(lesson, bm.block_pool, free0)
    a = _a_prefill_takes_three_blocks(lesson, engine, bm, greedy, free0)
    _b_takes_the_next_two_blocks(lesson, engine, greedy)
    _a_crosses_a_block_boundary(lesson, llm, a)
    _finished_requests_return_their_blocks(lesson, engine, bm, free0)
    _paging_wastes_less_than_contiguous(lesson)


def _block_0_is_the_null_block(lesson, pool, free0: int) -> None:
    lesson.say(f"The cache has {pool.num_gpu_blocks} blocks of {BLOCK} slots, but only {free0} are in the "
               "free-block queue: block 0 is the **null block**. As in vLLM V1's block pool, it is taken out once at "
               "startup and never given to a request, so a block-table entry of 0 can only mean *nothing here*.")
    lesson.check(free0 == pool.num_gpu_blocks - 1 and 0 not in pool.free_block_queue,
                 "block 0 is not in the free queue")


def _a_prefill_takes_three_blocks(lesson, engine, bm, greedy, free0: int):
    """A's 40-token prefill takes blocks 1, 2, 3 from the front of the free queue. Returns A."""
    a = queue_request(engine, "A", {"prompt_token_ids": list(range(40))}, greedy)
    lesson.say("Request **A** has a 40-token prompt.")
    lesson.predict("How many blocks does A's prefill take, and how full is the last one?",
                   f"ceil(40 / {BLOCK}) = {math.ceil(40 / BLOCK)} blocks; the last holds 40 - 2×16 = 8 tokens.")
    engine.step()  # the prefill: all 40 prompt tokens in one step
    lesson.show(block_table(a, BLOCK))
    lesson.check(len(a.block_ids) == 3, "after the prefill of a 40-token prompt, A's block table holds 3 blocks")
    lesson.check(a.num_computed_tokens - 2 * BLOCK == 8, "the last block holds 8 tokens; 8 slots are still free")
    lesson.check(bm.num_free_blocks == free0 - 3, f"3 blocks left the free-block queue: {free0 - 3} remain")
    lesson.check(a.block_ids == [1, 2, 3], "they came from the front of the queue: physical blocks 1, 2, 3")
    lesson.pause()
    return a


def _b_takes_the_next_two_blocks(lesson, engine, greedy) -> None:
    b = queue_request(engine, "B", {"prompt_token_ids": list(range(100, 120))}, greedy)
    engine.step()  # A decodes one token, B is admitted and prefilled in the same step
    lesson.say("Request **B** (20 tokens) arrives. Blocks come from the front of the free queue, so B "
               "takes the next two physical blocks.")
    lesson.show(block_table(b, BLOCK))
    lesson.check(b.block_ids == [4, 5], "B's blocks are physical blocks 4 and 5")
    lesson.pause()


def _a_crosses_a_block_boundary(lesson, llm, a) -> None:
    """A decodes until it needs a 4th block: logically contiguous, physically not."""
    engine = llm.llm_engine
    lesson.predict("A keeps decoding one token per step. At which step does A need a 4th block?",
                   "When it computes its 49th token (position 48): 48 slots fill 3 blocks exactly.")
    steps = 0
    while len(a.block_ids) == 3:
        engine.step()
        steps += 1
    lesson.show(block_table(a, BLOCK, title="A after it crossed a block boundary"))
    lesson.check(a.num_computed_tokens == 49, "A got its 4th block in the step that computed position 48")
    lesson.check(a.block_ids[:3] == [1, 2, 3] and a.block_ids[3] not in (1, 2, 3, 4, 5),
                 "A's 4th logical block is physical block %d: logically contiguous, physically not" % a.block_ids[3])
    lesson.say("Every attention kernel reads A's keys through this table: slot = "
               "block_table[pos // 16] × 16 + pos % 16. Nothing needs to be contiguous.")
    lesson.show(kv_blocks(llm), title="the KV cache (A/B = owner, ∅ = the null block, blank = free)")
    lesson.pause()


def _finished_requests_return_their_blocks(lesson, engine, bm, free0: int) -> None:
    while engine.has_unfinished_requests():
        engine.step()
    lesson.check(bm.num_free_blocks == free0, "finished requests return every block to the free queue")


def _paging_wastes_less_than_contiguous(lesson) -> None:
    """Fragmentation: paged versus contiguous pre-allocation, on 24 requests stopped mid-run."""
    lesson.say("Now a workload of 24 requests with varied lengths, stopped mid-run. For each running "
               "request we count slots **allocated** and slots **used**, paged (16-token blocks) versus "
               "the older scheme that reserves `max_model_len` contiguous slots per request.")
    llm2, _ = lesson.engine(block_size=BLOCK, num_kv_blocks=1024)
    e2 = llm2.llm_engine
    for i in range(24):
        e2.add_request(f"w{i}", {"prompt_token_ids": [(i * 7 + j) % 250 for j in range(5 + 9 * i % 70)]},
                       SamplingParams(temperature=0, max_tokens=20 + 3 * i, ignore_eos=True))
    for _ in range(10):
        e2.step()
    running = e2.engine_core.engine_core.scheduler.running
    used = sum(r.num_computed_tokens for r in running)
    paged = sum(len(r.block_ids) * BLOCK for r in running)
    contiguous = len(running) * e2.max_model_len
    lesson.show(table(["scheme", "slots allocated", "slots used", "wasted", "waste %"], [
        ["paged, 16-token blocks", paged, used, paged - used, f"{100 * (paged - used) / paged:.1f}"],
        [f"contiguous, max_model_len={e2.max_model_len}", contiguous, used, contiguous - used,
         f"{100 * (contiguous - used) / contiguous:.1f}"],
    ], title=f"{len(running)} running requests after 10 steps"))
    lesson.check(all(len(r.block_ids) * BLOCK - r.num_computed_tokens < BLOCK for r in running),
                 "paging wastes less than one block per request (only its last block is partly empty)")
    lesson.check(paged - used < (contiguous - used) / 10, "contiguous pre-allocation wastes over 10x more slots here")
    lesson.done("A request's KV lives in fixed-size blocks found through its block table. Blocks come "
                "from a free queue and go back when the request finishes. Waste is bounded by one partly "
                "filled block per request, instead of everything reserved but never used.")


if __name__ == "__main__":
    sys.exit(main(globals()))
