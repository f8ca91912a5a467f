"""Exercise 2: allocate blocks and a block table, prefix-cache hits included (lessons 5, 10, 11).

Graded inside the engine: the KV-cache manager's allocate_slots is the learner's (the engine
still registers full blocks in the prefix cache after it), and a workload that shares a
system prompt and runs out of blocks (preemption) must produce the engine's own output.
"""
from __future__ import annotations

from engine import LLM, SamplingParams
from engine.core.block_pool import NULL_BLOCK_ID
from engine.core.kv_cache_manager import KVCacheManager
from engine.request import Request
from lessons.exercises import Grader, greedy, learner_call
from lessons.framework import queue_request

TITLE = "Blocks and a block table"
SUMMARY = "new blocks, prefix-cache hits shared, all or nothing"
FUNCTION = "allocate_slots"
SIGNATURE = "def allocate_slots(bm, req, num_new_tokens: int, computed_blocks: list[int]) -> bool:"
CONTRACT = """
Give request `req` room in the paged KV cache for `num_new_tokens` more tokens.

req.block_ids is its block table (logical block i -> physical block id); req.num_computed_tokens
counts the tokens whose K/V it already has. computed_blocks are prefix-cache hits found when the
request is admitted: physical blocks that already hold its first len(computed_blocks) * bm.block_size
tokens; they come before the new tokens. Afterwards req.block_ids must hold exactly

    ceil((req.num_computed_tokens + len(computed_blocks) * bm.block_size + num_new_tokens) / bm.block_size)

blocks: the ones it had, then
  1. the hits, in order: each hit's pool.blocks[b].ref_cnt goes up by 1, and a hit whose ref_cnt was 0
     (cached but free) leaves the free queue: del pool.free_block_queue[b];
  2. then fresh blocks, from pool.get_new_blocks(n) (it pops n blocks off the front of the free queue,
     evicts any cached contents, and sets each one's ref_cnt = 1).
If that needs more blocks than are free (a hit with ref_cnt 0 also comes out of the free queue),
change NOTHING and return False, so the scheduler can preempt someone and try again.
Otherwise return True.

Useful: bm.block_size, bm.num_free_blocks, pool = bm.block_pool (the BlockPool): pool.blocks[b].ref_cnt,
pool.free_block_queue (an OrderedDict of free block ids).
"""
SOLUTION_BODY = """
bs, pool = bm.block_size, bm.block_pool
total = req.num_computed_tokens + len(computed_blocks) * bs + num_new_tokens
need_new = -(-total // bs) - len(req.block_ids) - len(computed_blocks)
hits_from_free = sum(1 for b in computed_blocks if pool.blocks[b].ref_cnt == 0)
if need_new > bm.num_free_blocks - hits_from_free:
    return False
for b in computed_blocks:
    if pool.blocks[b].ref_cnt == 0:
        del pool.free_block_queue[b]
    pool.blocks[b].ref_cnt += 1
    req.block_ids.append(b)
req.block_ids.extend(pool.get_new_blocks(max(0, need_new)))
return True
"""
BLOCK = 16


def _req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, None, tokens, SamplingParams(max_tokens=4), None, 4)


def state(bm: KVCacheManager) -> tuple:
    return list(bm.block_pool.free_block_queue), [b.ref_cnt for b in bm.block_pool.blocks]


def invariants(bm: KVCacheManager, reqs) -> str:
    """'' if the KV-cache manager's books balance, else what is wrong."""
    refs = [0] * bm.block_pool.num_gpu_blocks
    for r in reqs:
        if len(set(r.block_ids)) != len(r.block_ids):
            return f"request {r.request_id} holds a block twice: {r.block_ids}"
        for b in r.block_ids:
            refs[b] += 1
    if refs[NULL_BLOCK_ID]:
        return "block 0, the null block, is in a block table"
    for block in bm.block_pool.blocks[1:]:
        if block.ref_cnt != refs[block.block_id]:
            return (f"block {block.block_id} has ref_cnt {block.ref_cnt} but {refs[block.block_id]} block "
                    "table(s) hold it")
        if (block.block_id in bm.block_pool.free_block_queue) != (block.ref_cnt == 0):
            where = "in" if block.block_id in bm.block_pool.free_block_queue else "not in"
            return f"block {block.block_id} has ref_cnt {block.ref_cnt} yet is {where} the free queue"
    return ""


def allocate(fn, bm, req, n, computed=()):
    ok = learner_call(fn, bm, req, n, list(computed))
    if ok is True:  # what the engine's allocate_slots does after allocating: register full blocks in the cache
        bm.cache_blocks(req, req.num_computed_tokens + n + len(computed) * bm.block_size)
    return ok


def by_hand(fn, g: Grader) -> None:
    bm = KVCacheManager(8, 4, enable_caching=True)  # blocks of 4; block 0 is the null block
    a = _req("A", list(range(10)))
    ok = allocate(fn, bm, a, 10)
    g.check(ok is True, "it returns True when the blocks are there", f"returned {ok!r}")
    g.check(a.block_ids == [1, 2, 3], "a 10-token prompt gets ceil(10 / 4) = 3 blocks from the front of the free "
            "queue: [1, 2, 3] (block 0 is the null block)", f"its block table is {a.block_ids}")
    g.check(not invariants(bm, [a]), "reference counts and the free queue agree with the block tables",
            invariants(bm, [a]))
    a.num_computed_tokens = 10
    a.all_token_ids += [50, 51]
    allocate(fn, bm, a, 2)
    g.check(a.block_ids == [1, 2, 3], "2 more tokens (12) still fit in its 3 blocks: no new block",
            f"its block table became {a.block_ids}")
    a.num_computed_tokens = 12
    a.all_token_ids += [52]
    allocate(fn, bm, a, 1)
    g.check(len(a.block_ids) == 4 and a.block_ids[3] == 4, "the 13th token needs a 4th block: block 4",
            f"its block table became {a.block_ids}")
    a.num_computed_tokens = 13
    big = _req("B", list(range(100, 120)))  # 5 blocks; only 3 are free
    before = state(bm)
    ok = allocate(fn, bm, big, 20)
    g.check(ok is False and big.block_ids == [] and state(bm) == before,
            "asking for 5 blocks when 3 are free returns False and changes nothing",
            f"returned {ok!r}, block table {big.block_ids}, free queue {before[0]} -> {state(bm)[0]}")
    # prefix-cache hits: A's first two blocks hold tokens 0..7
    c = _req("C", list(range(10)))
    hits = bm.get_computed_blocks(c)[0][0]  # (the hit's blocks in the one KV-cache group)
    ok = allocate(fn, bm, c, 10 - 4 * len(hits), hits)
    g.check(ok is True and hits == [1, 2] and c.block_ids[:2] == [1, 2] and len(c.block_ids) == 3
            and bm.block_pool.blocks[1].ref_cnt == 2, "a request with A's first 8 tokens shares A's blocks 1 and 2 "
            "(ref_cnt 2) and gets one fresh block", f"hits {hits}, its block table {c.block_ids}, "
            f"ref_cnt of block 1 = {bm.block_pool.blocks[1].ref_cnt}")
    c.num_computed_tokens = 10
    bm.free(a)
    bm.free(c)
    d = _req("D", list(range(10)))
    hits = bm.get_computed_blocks(d)[0][0]
    free_before = bm.num_free_blocks
    allocate(fn, bm, d, 10 - 4 * len(hits), hits)
    g.check(hits == [1, 2] and d.block_ids[:2] == [1, 2] and not {1, 2} & set(state(bm)[0])
            and bm.num_free_blocks == free_before - 3,
            "hits on cached-but-free blocks take them out of the free queue (ref_cnt 0 -> 1)",
            f"hits {hits}, its block table {d.block_ids}, free queue {state(bm)[0]}")
    g.check(not invariants(bm, [d]), "the books still balance", invariants(bm, [d]))


SYSTEM = [(5 * i + 3) % 250 for i in range(40)]
# id -> (prompt, max_tokens): B and C share A's system prompt; the 8-block cache runs out
WORKLOAD = {"A": (SYSTEM + [1, 2], 12), "B": (SYSTEM + [7], 14), "C": (SYSTEM + [9, 9, 9], 12),
            "D": ([(11 * j) % 250 for j in range(30)], 10)}


def run_workload(engine, check_step=None) -> dict[str, list[int]]:
    reqs = {}
    for rid, (prompt, n) in WORKLOAD.items():
        reqs[rid] = queue_request(engine, rid, {"prompt_token_ids": prompt}, greedy(n))
        engine.step()
        if check_step:
            check_step(reqs)
    while engine.has_unfinished_requests():
        engine.step()
        if check_step:
            check_step(reqs)
    return {rid: r.output_token_ids for rid, r in reqs.items()}


def grade(fn, g: Grader, model: str = "tiny-gpt2") -> None:
    by_hand(fn, g)
    g.say("Now inside a real engine: its KV-cache manager allocates with your function.")
    kw = dict(block_size=BLOCK, num_kv_blocks=9, max_num_seqs=4, async_scheduling=False)  # 8 usable: too few for 4
    engine = LLM(model, **kw).llm_engine
    core = engine.engine_core.engine_core  # the EngineCore behind the InprocClient
    bm, original = core.kv_cache_manager, core.kv_cache_manager.allocate_slots
    bm.allocate_slots = lambda req, n, computed=None: allocate(fn, bm, req, n, computed[0] if computed else ())
    problems = []

    def after_step(reqs):
        live = [r for r in reqs.values() if r.block_ids]
        if not problems and invariants(bm, live):
            problems.append(f"step {core.step_count - 1}: {invariants(bm, live)}")

    outputs = run_workload(engine, after_step)
    st = core.stats()
    g.check(not problems, "after every step, reference counts and the free queue agree with the block tables",
            problems[0] if problems else "")
    g.check(st.prefix_cache_hits > 0, f"B and C hit A's cached system prompt ({st.prefix_cache_hits} tokens found)")
    g.check(st.num_preemptions > 0, f"the cache ran out and the scheduler preempted {st.num_preemptions} time(s) "
            "(a False from your function)")
    g.check(bm.num_free_blocks == bm.num_usable_blocks, "when all have finished, every block is free again",
            f"{bm.num_usable_blocks - bm.num_free_blocks} block(s) never came back")
    bm.allocate_slots = original
    ref = run_workload(LLM(model, **kw).llm_engine)
    bad = [r for r in ref if outputs[r] != ref[r]]
    g.check(not bad, "every request's greedy output is token for token the engine's own", f"{bad} differ")
