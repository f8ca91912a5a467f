"""Lesson 11: prefix caching — block hashes as a chain, cache hits on a shared prompt, LRU eviction."""
import pathlib
import sys
from dataclasses import dataclass

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # `python lessons/NN_x.py` from a checkout

from engine.core.block_pool import hash_block_tokens
from lessons.cli import main
from lessons.framework import greedy, queue_request, table

TITLE = "Prefix caching"
SUMMARY = ("A shared system prompt: chained block hashes, cache hits with shared blocks, the last token computed, "
           "LRU eviction, and a BPE boundary that breaks a hit.")
BLOCK = 16
# 48 tokens with the built-in tokenizer: exactly 3 blocks (the lesson checks it)
SYSTEM_TEXT = ("You are a helpful assistant for people who write Python. Answer each question about the language "
               "and its standard library in plain English, with a short code example when it helps.\n")
QUESTIONS = {"A": "How do I sort a list of tuples by their second item?", "B": "What does the with statement do?",
             "D": "Why is my loop slow?", "E": "How do I read a file line by line?"}


def short(h) -> str:
    return "—" if h is None else f"{h & 0xFFFFFFFF:08x}"


def traced_step(engine, sub) -> tuple[dict, list]:
    engine.step()
    events = sub.pull().events
    return next(e.attrs for e in events if (e.layer, e.name, e.kind) == ("scheduler", "schedule", "snapshot")), events


@dataclass
class Cache:
    """The engine and the parts of its prefix cache the sections read."""
    engine: object
    sub: object  # the trace bus subscription
    bm: object  # the KV-cache manager
    pool: object  # its block pool
    cached: dict  # block hash -> physical block id
    tok: object
    system: list[int]  # SYSTEM_TEXT's token ids


def run(lesson) -> None:
    lesson.intro(
        "Many requests start the same way: a system prompt, a few-shot preamble, a long document. The "
        "K and V of those tokens are the same every time, so vLLM keeps full KV blocks findable by a "
        "**hash** of their contents *and everything before them*, and a new request whose prompt starts "
        "the same way reuses them instead of computing them again. You will watch the hashes, the hits, "
        "shared blocks with reference counts, and what happens when the cache runs short.")
    llm, session = lesson.engine(block_size=BLOCK, num_kv_blocks=13)  # 12 usable besides the null block
    engine, bm = llm.llm_engine, llm.llm_engine.engine_core.engine_core.kv_cache_manager
    pool = bm.block_pool
    cached = pool.cached_block_hash_to_block  # block hash -> physical block id
    tok = engine.tokenizer
    sub = session.bus.subscribe()
    SYSTEM = tok.encode(SYSTEM_TEXT)
    lesson.say(f"Every request below starts with the same **system prompt**:\n\n> {SYSTEM_TEXT.strip()}")
    lesson.check(len(SYSTEM) == 3 * BLOCK, f"the system prompt is {len(SYSTEM)} tokens: exactly 3 blocks of {BLOCK}")
    cache = Cache(engine, sub, bm, pool, cached, tok, SYSTEM)

    a, a_blocks, hs = _block_hashes_form_a_chain(lesson, cache)
    lesson.pause()
    b = _a_shared_prefix_hits(lesson, cache, a)
    lesson.pause()
    c, c_blocks = _the_last_token_is_always_computed(lesson, cache, a)
    lesson.pause()
    uncached, cached_order = _freed_blocks_stay_cached(lesson, cache, hs, a_blocks, c_blocks)
    x = _new_blocks_evict_the_least_recently_used(lesson, cache, hs, a_blocks, uncached, cached_order)
    d = _an_evicted_block_breaks_the_chain(lesson, cache)
    warm, e = _a_bpe_boundary_breaks_a_hit(lesson, cache)
    _the_counters(lesson, cache, [a, b, c, x, d, warm, e])
    lesson.done("Full KV blocks are named by a chained hash of all tokens up to their end, so one lookup per "
                "block finds the longest cached prefix. Hits share physical blocks (reference counts); only "
                "the rest of the prompt is computed, and never less than its last token. Freed blocks keep "
                "their contents until a new request needs them, taken least recently used first, which "
                "evicts them from the cache. The cache matches token ids, not text: where BPE merges across the "
                "end of a shared prefix, the same text is a different token prefix.")


def _block_hashes_form_a_chain(lesson, cache: Cache):
    """Request A's full blocks are registered under chained hashes. Returns A, its blocks and its hashes."""
    engine, pool, cached, tok, SYSTEM = cache.engine, cache.pool, cache.cached, cache.tok, cache.system
    a = queue_request(engine, "A", SYSTEM_TEXT + QUESTIONS["A"], greedy(6))
    traced_step(engine, cache.sub)
    a_blocks = list(a.block_ids)
    n_own = a.num_prompt_tokens - 48
    lesson.say(f"Request **A** = the system prompt + its question, {QUESTIONS['A']!r} ({n_own} tokens). After its "
               "prefill, its full blocks are registered in the cache. Each hash covers (parent hash, the block's "
               "token ids); vLLM also mixes in extra keys where they apply, such as a LoRA adapter or a cache salt.")
    lesson.check(a.prompt_token_ids[:48] == SYSTEM,
                 "A's first 48 token ids are the system prompt's: the newline it ends with is a token of its own, "
                 "so the question's first word does not merge across the boundary")
    rows = []
    for i, phys in enumerate(a.block_ids):
        h = a.block_hashes[i] if i < len(a.block_hashes) else None
        parent = a.block_hashes[i - 1] if 0 < i <= len(a.block_hashes) else None
        toks = a.all_token_ids[i * BLOCK:(i + 1) * BLOCK]
        rows.append([i, phys, repr(tok.decode(toks[:6])) + " …", len(toks) if i < 3 else a.num_prompt_tokens - 48,
                     short(parent), short(h), "yes" if h is not None and cached.get(h) == phys else "no"])
    lesson.show(table(["logical", "physical", "text of its first 6 tokens", "n", "parent hash", "hash", "in cache"],
                      rows, title="A's blocks (hashes shortened to 32 bits)"))
    hs = a.block_hashes
    lesson.check(len(hs) == 3 and hs[0] == hash_block_tokens(None, tuple(SYSTEM[:16]))
                 and all(hs[i] == hash_block_tokens(hs[i - 1], tuple(SYSTEM[i * 16:(i + 1) * 16])) for i in (1, 2)),
                 "each block's hash = hash(parent's hash, its 16 token ids): a chain")
    lesson.check(all(cached[h] == a.block_ids[i] for i, h in enumerate(hs)) and len(cached) == 3,
                 f"A's 3 full blocks are in the cache; its 4th block ({n_own} tokens, not full) is not")
    other_first = [t + 1 for t in SYSTEM[:16]]
    lesson.check(hash_block_tokens(hash_block_tokens(None, tuple(other_first)), tuple(SYSTEM[16:32])) != hs[1],
                 "the same 16 tokens after a different first block hash differently: a hash names the whole prefix")
    lesson.say("That is why a hit on block *i* also means blocks 0…*i*−1 match: the lookup walks the chain "
               "from the first block and stops at the first miss.")
    lesson.check(all(pool.blocks[bid].token_ids == tuple(SYSTEM[i * 16:(i + 1) * 16])
                     for i, bid in enumerate(a.block_ids[:3])),
                 "our cache also keeps each cached block's 16 token ids beside its hash, and a lookup compares "
                 "them (KVCacheManager.get_computed_blocks): a hash collision cannot give a wrong hit here")
    lesson.say("That comparison is **ours, not vLLM's**. vLLM keys the cache on the block hash alone and trusts "
               "it: `hash_block_tokens` in `vllm/v1/core/kv_cache_utils.py` hashes (parent hash, token ids, extra "
               "keys) with SHA-256 by default (`CacheConfig.prefix_caching_hash_algo` in `vllm/config/cache.py`), "
               "and `BlockPool.get_cached_block` in `vllm/v1/core/block_pool.py` finds a hit by that hash with no "
               "look at the tokens (its config's docs name SHA-256 the default to make collisions practically "
               "impossible). Our hash is Python's 64-bit `hash()`, fast but not collision-resistant, so we check "
               "the tokens too.")
    return a, a_blocks, hs


def _a_shared_prefix_hits(lesson, cache: Cache, a):
    """Request B shares A's first 3 blocks (reference count 2) and computes only its own tokens."""
    engine, pool = cache.engine, cache.pool
    b = queue_request(engine, "B", SYSTEM_TEXT + QUESTIONS["B"], greedy(6))
    n_b = b.num_prompt_tokens - 48
    lesson.predict(f"Request B = the same system prompt + another question, {QUESTIONS['B']!r} ({n_b} tokens, "
                   f"{b.num_prompt_tokens} in all). How many tokens does its prefill compute?",
                   f"{n_b}: its first 48 tokens are 3 cached blocks.")
    snap, events = traced_step(engine, cache.sub)
    sb = next(s for s in snap["scheduled"] if s["request_id"] == "B")
    hit = next(e for e in events if (e.layer, e.request_id) == ("block_manager", "B") and e.name.startswith("cache_"))
    lesson.show(table(["logical", "B's physical", "A's physical", "ref count"],
                      [[i, p, a.block_ids[i] if i < len(a.block_ids) else "", pool.blocks[p].ref_cnt]
                       for i, p in enumerate(b.block_ids)], title="B's block table after step 1"))
    lesson.check(hit.name == "cache_hit" and hit.attrs["hit_tokens"] == 48 and b.num_cached_tokens == 48,
                 "B hit 48 tokens in the cache (num_cached_tokens = 48; trace: cache_hit)")
    lesson.check(sb["num_computed_before"] == 48 and sb["num_tokens"] == n_b,
                 f"step 1 computed only B's last {n_b} prompt tokens, starting at position 48")
    lesson.check(b.block_ids[:3] == a.block_ids[:3] and all(pool.blocks[p].ref_cnt == 2 for p in b.block_ids[:3]),
                 "B's first 3 logical blocks are A's physical blocks, each now with reference count 2")
    lesson.check(b.block_ids[3] not in a.block_ids and pool.blocks[b.block_ids[3]].ref_cnt == 1,
                 "B's 4th block, where it differs from A, is its own")
    return b


def _the_last_token_is_always_computed(lesson, cache: Cache, a):
    """Request C is the system prompt alone: a full hit, capped so its last block is computed again.
    Returns C and its blocks."""
    engine = cache.engine
    c = queue_request(engine, "C", SYSTEM_TEXT, greedy(6))
    lesson.predict("Request C is exactly the 48-token system prompt: all 3 of its blocks are cached. "
                   "How many tokens does its prefill compute?",
                   "16. To sample C's first token the engine needs the logits at its last prompt position, so "
                   "that token must run through the model. The hit is capped at 47 tokens, and since hits are "
                   "whole blocks, that means 2 blocks (32 tokens); the 3rd block is computed again.")
    snap, _ = traced_step(engine, cache.sub)
    sc = next(s for s in snap["scheduled"] if s["request_id"] == "C")
    c_blocks = list(c.block_ids)
    lesson.check(c.num_cached_tokens == 32 and sc["num_computed_before"] == 32 and sc["num_tokens"] == 16,
                 "C hit 32 tokens and computed 16, although all 48 were in the cache")
    lesson.check(c.block_ids[:2] == a.block_ids[:2] and c.block_ids[2] != a.block_ids[2]
                 and cache.pool.blocks[a.block_ids[0]].ref_cnt == 3,
                 "C shares A's first 2 blocks (reference count 3 now) and got a fresh 3rd block")
    return c, c_blocks


def _freed_blocks_stay_cached(lesson, cache: Cache, hs, a_blocks, c_blocks):
    """Finished requests' blocks are free but keep their contents, queued behind the never-cached ones.
    Returns the queue's uncached blocks and its cached ones, front first."""
    engine, bm, pool, cached = cache.engine, cache.bm, cache.pool, cache.cached
    while engine.has_unfinished_requests():
        engine.step()
    queue = list(pool.free_block_queue)
    lesson.say("All three have finished. Their blocks went back to the free queue, but blocks with a hash "
               "**keep their contents**: they are *cached-free*, counted as free, yet still findable. New "
               "blocks are taken from the front of the queue: blocks without cached contents first, then "
               "cached ones, least recently used first (a finished request's blocks are queued tail first, "
               "so its shared head stays longest). Block %d holds the same tokens as block %d (C computed "
               "its 3rd block again), so it carries the same hash; the cache's index points to block %d."
               % (c_blocks[2], a_blocks[2], a_blocks[2]))
    lesson.show(table(["queue position", "block", "cached contents"],
                      [[i, bid, short(pool.blocks[bid].block_hash) if pool.blocks[bid].block_hash is not None else ""]
                       for i, bid in enumerate(queue)], title="the free-block queue, front first"))
    lesson.check(bm.num_free_blocks == bm.num_usable_blocks and all(h in cached for h in hs),
                 "every block is free, and the system prompt's 3 hashes are still in the cache")
    uncached = [bid for bid in queue if pool.blocks[bid].block_hash is None]
    cached_order = [bid for bid in queue if pool.blocks[bid].block_hash is not None]
    lesson.check(
        queue == uncached + cached_order,
        "blocks without cached contents are at the front, cached-free ones behind them",
    )
    return uncached, cached_order


def _new_blocks_evict_the_least_recently_used(lesson, cache: Cache, hs, a_blocks, uncached, cached_order):
    """Request X needs more blocks than the never-cached ones: it evicts the LRU cached-free blocks."""
    engine, pool, cached = cache.engine, cache.pool, cache.cached
    x_len = 150  # needs 10 blocks: more than the never-cached ones
    need = -(-(x_len + 2) // BLOCK)
    n_evict = need - len(uncached)
    lesson.predict(f"Request X (an unrelated {x_len}-token prompt) needs {need} blocks; {len(uncached)} are "
                   "without cached contents. Which cached blocks does it take?",
                   f"The {n_evict} least recently used cached-free blocks, from the front of the queue: "
                   f"{cached_order[:n_evict]}. Their old contents are evicted from the cache.")
    victims = cached_order[:n_evict]
    victim_hashes = [pool.blocks[v].block_hash for v in victims]
    x = queue_request(engine, "X", {"prompt_token_ids": [(11 * j) % 256 for j in range(x_len)]}, greedy(2))
    _, events = traced_step(engine, cache.sub)
    evicted = [b for e in events if (e.layer, e.name) == ("block_manager", "evict") for b in e.attrs["block_ids"]]
    lesson.show(table(["block", "evicted hash", "still in cache?"],
                      [[v, short(h), "yes" if h in cached else "no"] for v, h in zip(victims, victim_hashes)],
                      title="evicted for X (trace: block_manager evict)"))
    lesson.check(x.block_ids == uncached + victims and evicted == victims,
                 f"X took the uncached blocks first, then evicted the LRU cached-free blocks {victims}")
    lesson.check(a_blocks[2] in victims and hs[2] not in cached,
                 "the system prompt's 3rd block was among them: its hash is gone from the cache")
    lesson.check(
        hs[0] in cached and hs[1] in cached, "its first two blocks, further back in the queue, are still cached"
    )
    return x


def _an_evicted_block_breaks_the_chain(lesson, cache: Cache):
    """Request D, with the system prompt again, hits only the 2 blocks before the evicted one."""
    engine = cache.engine
    while engine.has_unfinished_requests():
        engine.step()
    d = queue_request(engine, "D", SYSTEM_TEXT + QUESTIONS["D"], greedy(2))
    traced_step(engine, cache.sub)
    lesson.check(d.num_cached_tokens == 32,
                 "a new request with the system prompt now hits only 32 tokens: the chain breaks at the evicted block")
    while engine.has_unfinished_requests():
        engine.step()
    return d


def _a_bpe_boundary_breaks_a_hit(lesson, cache: Cache):
    """A warm-up prompt ending in a space: the user's text extends it, but BPE merges the space into the next
    word, so the token ids, and the 3rd block's hash, differ. Returns the warm-up request and the user's."""
    engine, tok = cache.engine, cache.tok
    spaced = SYSTEM_TEXT.rstrip("\n") + " "
    warm = queue_request(engine, "warm", spaced, greedy(1))
    while engine.has_unfinished_requests():
        engine.step()
    e_text = spaced + QUESTIONS["E"]
    e_ids = tok.encode(e_text)
    lesson.say("Some servers **warm** the cache by sending the system prompt alone before any user arrives. "
               f"Here the app's template ends its system prompt with a space instead of a newline: {spaced[-20:]!r}. "
               f"The warm-up request computed it, so its 3 blocks are cached. Then a user asks "
               f"{QUESTIONS['E']!r}: the prompt's **text** starts with the whole warm-up prompt.")
    lesson.show(table(["position", "warm-up prompt", "user's prompt"],
                      [[i, repr(tok.convert_ids_to_tokens(warm.prompt_token_ids[i])),
                        repr(tok.convert_ids_to_tokens(e_ids[i]))] for i in range(44, 48)],
                      title="the last tokens of block 2 (Ġ is a space)"))
    lesson.predict("How many of the user's prompt tokens hit the cache?",
                   "32, not 48. Alone, the trailing space is a token of its own ('Ġ'); followed by a word, BPE "
                   "merges the space into that word's token, so token 47 differs and with it the 3rd block's hash. "
                   "The prefix cache matches token ids, not text.")
    e = queue_request(engine, "E", e_text, greedy(2))
    traced_step(engine, cache.sub)
    lesson.check(e_text.startswith(warm.prompt) and e.prompt_token_ids[:47] == warm.prompt_token_ids[:47]
                 and e.prompt_token_ids[47] != warm.prompt_token_ids[47],
                 "the text is a prefix, but the token ids differ at position 47, the space's token")
    lesson.check(warm.num_prompt_tokens == 48 and cache.cached.get(warm.block_hashes[2]) is not None
                 and e.num_cached_tokens == 32,
                 "the warm-up's 3rd block is in the cache, yet the user's request hit only 32 tokens")
    lesson.say("The same holds for any boundary BPE merges across. A system prompt that ends in a newline (as "
               "A–D's did) or a chat template's special tokens keeps the boundary fixed.")
    while engine.has_unfinished_requests():
        engine.step()
    return warm, e


def _the_counters(lesson, cache: Cache, everyone) -> None:
    """The engine's prefix-cache counters add up every request's prompt and cached tokens."""
    st = cache.engine.engine_core.engine_core.stats()
    queries, hits = sum(r.num_prompt_tokens for r in everyone), sum(r.num_cached_tokens for r in everyone)
    lesson.show(table(["request", "prompt tokens", "cached tokens"],
                      [[r.request_id, r.num_prompt_tokens, r.num_cached_tokens] for r in everyone]
                      + [["total", queries, hits]], title="prefix-cache lookups"))
    lesson.check(st.prefix_cache_queries == queries and st.prefix_cache_hits == hits,
                 f"the engine's counters: prefix_cache_queries = {st.prefix_cache_queries} tokens looked up, "
                 f"prefix_cache_hits = {st.prefix_cache_hits} tokens found (hit rate {hits / queries:.0%})")
    lesson.say("A server exports these as the Prometheus counters `vllm:prefix_cache_queries` and "
               "`vllm:prefix_cache_hits` (in tokens); their ratio is the hit rate.")


if __name__ == "__main__":
    sys.exit(main(globals()))
