"""Lesson 19: one prompt, many samples — n > 1 shares the prompt's blocks; priority scheduling."""
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # `python lessons/NN_x.py` from a checkout

from engine import SamplingParams
from lessons.cli import main
from lessons.framework import table

TITLE = "One prompt, many samples"
SUMMARY = ("n = 4 samples of one prompt: four child requests whose block tables share the prompt's blocks "
           "(reference count 4) until they diverge; what preemption does to a child; and the same burst under "
           "FCFS and priority scheduling.")
BLOCK = 16
SYSTEM = ("You are a helpful assistant for people who write Python. Answer each question about the language "
          "and its standard library in plain English.\nHow do I sort a list?")
N = 4


def run(lesson) -> None:
    lesson.intro(
        "`n` asks for several samples of one prompt. vLLM V1 does not run one request n times: its front end "
        "(`vllm/v1/engine/parallel_sampling.py`, `ParentRequest`) fans the request out into **n child "
        "requests** with ids `0_<id>` … `n-1_<id>`, each with `n = 1` and, for a seeded request, seed + i. The "
        "engine core schedules them like any others; the prompt is the same tokens, so the prefix cache makes "
        "their block tables point at the **same physical blocks**, and the output processor gathers their "
        "tokens back into one `RequestOutput` with n completions.")
    llm, session = lesson.engine(block_size=BLOCK, num_kv_blocks=64)
    engine = llm.llm_engine
    _children_share_the_prompts_blocks(lesson, engine)
    lesson.pause()

    _one_output_gathers_the_children(lesson, engine)
    lesson.pause()

    # ---- preemption of a child ----
    _a_child_is_preempted_like_any_request(lesson)
    lesson.pause()

    # ---- priority ----
    _fcfs_versus_priority(lesson)
    lesson.done(
        "n > 1 is n child requests sharing the prompt's KV blocks through the prefix cache and reference counts, "
        "gathered into one output by the front end; each child is scheduled, preempted and freed on its own. "
        "Priority scheduling reorders the waiting queue and picks preemption victims by (priority, arrival).")


def _children_share_the_prompts_blocks(lesson, engine) -> None:
    """One step of an n = 4 request: the children's block tables share the prompt's full blocks."""
    core = engine.engine_core.engine_core  # the EngineCore behind the InprocClient
    bm = core.kv_cache_manager
    pool = bm.block_pool
    engine.add_request("ask", SYSTEM, SamplingParams(n=N, temperature=0.9, seed=7, max_tokens=24))
    engine.step()
    children = [core.requests[f"{i}_ask"] for i in range(N)]
    prompt_len = children[0].num_prompt_tokens
    full = (prompt_len - 1) // BLOCK  # full prompt blocks: the prefix cache can share these
    lesson.show(table(["child", "seed", "block table", "reference counts"], [
        [c.request_id, c.params.seed, " ".join(map(str, c.block_ids)),
         " ".join(str(pool.blocks[b].ref_cnt) for b in c.block_ids)] for c in children],
        title=f"after the first step: a {prompt_len}-token prompt, {N} children"))
    shared = children[0].block_ids[:full]
    lesson.check(full >= 1 and all(c.block_ids[:full] == shared for c in children),
                 f"every child's first {full} block(s) are the same physical blocks {shared}")
    lesson.check(all(pool.blocks[b].ref_cnt == N for b in shared), f"each shared block has reference count {N}")
    tails = [c.block_ids[full:] for c in children]
    lesson.check(len({tuple(t) for t in tails}) == N,
                 "the block holding the prompt's last tokens is each child's own: each computes that token, whose "
                 "logits it samples from, and writes its own continuation after it")
    lesson.say(f"The first child computed the prompt; the other {N - 1}, admitted in the same step, found its "
               "full blocks in the prefix cache (their K/V are written earlier in the same forward pass, layer by "
               "layer, before any attention reads them) and computed only the last, partial block.")
    lesson.check(children[0].num_cached_tokens == 0 and
                 all(c.num_cached_tokens == full * BLOCK for c in children[1:]),
                 f"child 0 found nothing cached; children 1..{N - 1} found {full * BLOCK} tokens each")


def _one_output_gathers_the_children(lesson, engine) -> None:
    """Run to the end: the front end gathers the children into one RequestOutput; every block is freed."""
    bm = engine.engine_core.engine_core.kv_cache_manager
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    [out] = outs
    lesson.show(table(["index", "text"], [[c.index, repr(c.text[:60])] for c in out.outputs],
                      title="one RequestOutput, four completions (the output processor gathered them)"))
    lesson.check([c.index for c in out.outputs] == list(range(N)) and len({c.text for c in out.outputs}) > 1,
                 f"{N} completions, indexed 0..{N - 1}, and sampling made them differ")
    lesson.check(bm.num_free_blocks == bm.num_usable_blocks, "when they finish, every block is free again")


def _a_child_is_preempted_like_any_request(lesson) -> None:
    lesson.say("**Preemption.** Children are ordinary requests to the scheduler: when blocks run short, a child "
               "can be preempted like any request, and recomputed later; its siblings go on.")
    small, _ = lesson.engine(block_size=4, num_kv_blocks=12, enable_prefix_caching=True)
    e2 = small.llm_engine
    c2 = e2.engine_core.engine_core
    e2.add_request("tight", {"prompt_token_ids": list(range(1, 13))},
                   SamplingParams(n=3, temperature=0, max_tokens=14, ignore_eos=True))
    preempted = set()
    while e2.has_unfinished_requests():
        done = [o for o in e2.step() if o.finished]
        preempted |= {r.request_id for r in c2.scheduler.waiting if r.num_preemptions}
        final = done[0] if done else None
    lesson.check(bool(preempted), f"a cache of 11 blocks of 4 cannot hold three 26-token children: "
                                  f"{', '.join(sorted(preempted))} were preempted")
    lesson.check(len({tuple(c.token_ids) for c in final.outputs}) == 1,
                 "greedy children recomputed after preemption still agree token for token")
    lesson.check(c2.kv_cache_manager.num_free_blocks == c2.kv_cache_manager.num_usable_blocks,
                 "and no block is leaked")


def _fcfs_versus_priority(lesson) -> None:
    """The same burst of six requests, one seat, under FCFS and under priority scheduling: measured queue times."""
    lesson.say("**Priority.** vLLM V1's other scheduling policy (`--scheduling-policy priority`): each request "
               "carries a `priority`, lower first, ties by arrival; the waiting queue is kept in that order, and "
               "when blocks run out the victim is the running request with the largest (priority, arrival). The "
               "same burst of six requests, one seat (`max_num_seqs=1`), under both policies:")
    burst = [("a", 3), ("b", 0), ("c", 2), ("d", 0), ("e", 1), ("f", 3)]
    waits = {}
    for policy in ("fcfs", "priority"):
        pl, _ = lesson.engine(block_size=BLOCK, num_kv_blocks=64, max_num_seqs=1, scheduling_policy=policy)
        outs = pl.generate([{"prompt_token_ids": [7, 8, 9, i]} for i in range(len(burst))],
                           SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False,
                           priority=[p for _, p in burst])
        steps = [o.metrics["first_scheduled_time"] - o.metrics["arrival_time"] for o in outs]
        waits[policy] = dict(zip((r for r, _ in burst), steps))
    lesson.show(table(["request", "priority", "queue time, fcfs (ms)", "queue time, priority (ms)"], [
        [r, p, f"{waits['fcfs'][r] * 1000:.1f}", f"{waits['priority'][r] * 1000:.1f}"] for r, p in burst],
        title="time from arrival to first scheduled, measured"))
    order = sorted(waits["priority"], key=waits["priority"].get)
    lesson.check(order == ["b", "d", "e", "c", "a", "f"],
                 f"under priority they started in the order {' '.join(order)}: priority 0 first (b before d, "
                 "by arrival), then 1, 2, 3")
    lesson.check(waits["priority"]["d"] < waits["fcfs"]["d"] and waits["priority"]["a"] > waits["fcfs"]["a"],
                 "d (priority 0, 4th to arrive) waited less than under FCFS; a (priority 3, first to arrive) more")


if __name__ == "__main__":
    sys.exit(main(globals()))
