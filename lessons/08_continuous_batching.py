"""Lesson 8: continuous batching — requests join and leave the running batch at every step."""
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # `python lessons/NN_x.py` from a checkout

from lessons.cli import main
from lessons.framework import greedy, queue_request, queues, table

TITLE = "Continuous batching"
SUMMARY = "Requests join and leave the running batch step by step; measured against static batching."
BLOCK = 16


def prompt(i: int, n: int = 12) -> dict:
    return {"prompt_token_ids": [(i * 31 + j) % 250 for j in range(n)]}


def traced_step(engine, sub) -> tuple[dict, list]:
    """One engine step; returns its schedule snapshot (from the trace) and all its events."""
    engine.step()
    events = sub.pull().events
    snap = next(e.attrs for e in events if (e.layer, e.name, e.kind) == ("scheduler", "schedule", "snapshot"))
    return snap, events


def run(lesson) -> None:
    lesson.intro(
        "A server does not wait to collect a full batch and then run it to the end. vLLM's scheduler "
        "rebuilds the batch at **every step**: a request that arrived since the last step is admitted "
        "at once (if the token budget and free blocks allow), and a request that finished leaves at "
        "once, giving its KV-cache blocks back. This is **continuous batching** (also called "
        "iteration-level scheduling). You will add requests *between* `engine.step()` calls and watch "
        "the running set change, then measure it against static batching on the same workload.")
    llm, session = lesson.engine(block_size=BLOCK, num_kv_blocks=64, enable_prefix_caching=False)
    bm = llm.llm_engine.engine_core.engine_core.kv_cache_manager
    sub = session.bus.subscribe()  # events from now on

    snaps, events_by_step, held_before = _requests_join_between_steps(lesson, llm, sub, bm)
    _requests_join_and_leave_at_once(lesson, bm, snaps, events_by_step, held_before)
    lesson.pause()

    # ---- static versus continuous, same workload ----
    _static_versus_continuous(lesson)
    lesson.done("The scheduler decides the batch anew at every step. New requests join as soon as there is "
                "budget and KV-cache room; finished requests leave and free their blocks in the step they "
                "finish. Nobody waits for the longest member of a batch, so fewer steps are wasted on empty seats.")


def _requests_join_between_steps(lesson, llm, sub, bm) -> tuple[dict, dict, dict]:
    """Run the engine while A, B, C and D arrive at their steps; show the running batch step by step.
    Returns each step's schedule snapshot, its events, and the block tables held before it."""
    engine = llm.llm_engine
    arrivals = {0: [("A", 10), ("B", 5)], 2: [("C", 6)], 5: [("D", 4)]}  # step -> (id, max_tokens)
    lesson.say("The plan: **A** (10 tokens to generate) and **B** (5) arrive before step 0, **C** (6) "
               "arrives before step 2 and **D** (4) before step 5. Every prompt is 12 tokens.")
    reqs, rows, snaps, events_by_step = {}, [], {}, {}
    held_before = {}
    while engine.has_unfinished_requests() or engine.engine_core.engine_core.step_count <= max(arrivals):
        k = engine.engine_core.engine_core.step_count
        for rid, n in arrivals.get(k, []):
            reqs[rid] = queue_request(engine, rid, prompt(ord(rid)), greedy(n))
        held_before[k] = {rid: list(r.block_ids) for rid, r in reqs.items()}
        if k == 2:
            lesson.say("Before step 2: **C** has just arrived. A and B are in the middle of decoding.")
            lesson.show(queues(llm))
            lesson.predict("Will C wait until A and B are done, or join them in step 2?",
                           "It joins in step 2: running requests are scheduled first (one decode token "
                           "each), then C is admitted with its whole 12-token prompt in the same step.")
        snap, events = traced_step(engine, sub)
        snaps[k], events_by_step[k] = snap, events
        left = [e.request_id for e in events if (e.layer, e.name) == ("engine", "FINISHED")]
        rows.append([k, " ".join(f"{s['request_id']}:{s['num_tokens']}{'p' if s['kind'] == 'prefill' else 'd'}"
                                 for s in snap["scheduled"]),
                     " ".join(snap["admitted"]) or "", " ".join(left), bm.num_free_blocks])
    lesson.show(table(["step", "scheduled (id:tokens, p=prefill d=decode)", "joined", "left", "free blocks after"],
                      rows, title="the running batch, step by step (from the trace)"))
    return snaps, events_by_step, held_before


def _requests_join_and_leave_at_once(lesson, bm, snaps: dict, events_by_step: dict, held_before: dict) -> None:
    """C joins in the step it arrived; B leaves, and frees its blocks, in the step it finished."""
    s2 = {s["request_id"]: s for s in snaps[2]["scheduled"]}
    lesson.check("C" in snaps[2]["admitted"] and s2["C"]["num_tokens"] == 12,
                 "C arrived before step 2 and was admitted in step 2 with its whole 12-token prompt")
    lesson.check(s2["A"]["kind"] == s2["B"]["kind"] == "decode" and s2["A"]["num_tokens"] == s2["B"]["num_tokens"] == 1,
                 "in that same step A and B each decoded one token: nobody waited for anybody")
    finish_step = {e.request_id: k for k, evs in events_by_step.items() for e in evs
                   if (e.layer, e.name) == ("engine", "FINISHED")}
    kb = finish_step["B"]
    freed = [e for e in events_by_step[kb] if (e.layer, e.name, e.request_id) == ("block_manager", "free", "B")]
    lesson.check(kb == 4 and freed and sorted(freed[0].attrs["block_ids"]) == sorted(held_before[kb]["B"]),
                 f"B finished in step {kb} (its 5th token) and its blocks {held_before[kb]['B']} went back "
                 "to the free queue in that same step")
    lesson.check(all(s["request_id"] != "B" for k in snaps if k > kb for s in snaps[k]["scheduled"]),
                 "B is in no later step's batch")
    lesson.check("D" in snaps[5]["admitted"] and {"A", "C"} <= {s["request_id"] for s in snaps[5]["scheduled"]},
                 "D joined in step 5, the step after it arrived, next to A and C")
    lesson.check(len({tuple(sorted(s["request_id"] for s in snaps[k]["scheduled"])) for k in snaps}) >= 4,
                 "the batch had at least four different member sets over the run")
    lesson.check(bm.num_free_blocks == bm.num_usable_blocks, "when all have finished, every block is free again")


def _static_versus_continuous(lesson) -> None:
    """The same 8 requests in 4 seats, batched statically and continuously, on the real engine."""
    lengths = [20, 3, 5, 18, 4, 16, 2, 6]
    seats = 4
    lesson.say(
        f"Now a workload of {len(lengths)} requests that want {', '.join(map(str, lengths))} tokens, "
        f"with room for **{seats}** requests in a batch (`max_num_seqs={seats}`).\n\n"
        f"- **Static batching**: take {seats} requests, run them until the *last* of them finishes, then "
        f"take the next {seats}. A request that finished early leaves its seat empty until then.\n"
        f"- **Continuous batching**: all {len(lengths)} are queued; whenever a request finishes, the next "
        "one takes its seat in the very next step.\n\n"
        f"A *slot* is one seat for one step ({seats} per step). A slot that computes no token is wasted.")
    batches = [lengths[i:i + seats] for i in range(0, len(lengths), seats)]
    lesson.predict("How many steps will static batching take?",
                   " + ".join(str(max(b)) for b in batches) + f" = {sum(max(b) for b in batches)} steps. Each "
                   "batch lasts as long as its longest member (" + ", ".join(
                       f"max({', '.join(map(str, b))}) = {max(b)}" for b in batches) + "), and a request needs "
                   "one step per token: its prefill step samples the first token, each decode step one more.")
    static = measure(lesson, lengths, batches, seats, static=True)
    cont = measure(lesson, lengths, batches, seats, static=False)
    _compare_the_schemes(lesson, static, cont, lengths, batches, seats)


def measure(lesson, lengths: list[int], batches: list[list[int]], seats: int, static: bool) -> dict:
    """Run the workload on a fresh engine with `seats` seats: steps, busy slots and wall time."""
    llm2, _ = lesson.engine(block_size=BLOCK, num_kv_blocks=128, max_num_seqs=seats, enable_prefix_caching=False)
    e2 = llm2.llm_engine
    steps = busy = 0
    t0 = time.perf_counter()
    groups = batches if static else [lengths]
    i = 0
    for group in groups:
        for n in group:
            e2.add_request(f"r{i}", prompt(i, 8), greedy(n))
            i += 1
        while e2.has_unfinished_requests():  # static: the next batch waits for the whole group
            busy += len(e2.step())  # one output per scheduled request (each sampled a token)
            steps += 1
    return dict(steps=steps, busy=busy, seconds=time.perf_counter() - t0)


def _compare_the_schemes(lesson, static: dict, cont: dict, lengths: list[int], batches: list[list[int]],
                         seats: int) -> None:
    tokens = sum(lengths)
    lesson.show(table(["scheme", "steps", "tokens", "slots", "wasted", "tokens/step", "time (s)"],
                      [[name, m["steps"], tokens, m["steps"] * seats, m["steps"] * seats - tokens,
                        f"{tokens / m['steps']:.2f}", f"{m['seconds']:.2f}"]
                       for name, m in (("static", static), ("continuous", cont))],
                      title="the same 8 requests on the real engine (slots = steps × 4)"))
    lesson.check(static["steps"] == sum(max(b) for b in batches),
                 f"static batching took {static['steps']} steps: each batch lasts as long as its longest member")
    lesson.check(static["busy"] == cont["busy"] == tokens,
                 "both schemes computed exactly one token per busy slot: the same useful work")
    lesson.check(cont["steps"] < static["steps"] and cont["steps"] >= -(-tokens // seats),
                 f"continuous batching needed {cont['steps']} steps (at least ceil({tokens}/{seats}) = "
                 f"{-(-tokens // seats)}), fewer than static's {static['steps']}")
    lesson.check(cont["steps"] * seats - tokens < static["steps"] * seats - tokens,
                 "continuous batching wasted fewer slots: a freed seat is refilled the next step")
    lesson.say("The wall time is shown for scale only; on a shared CPU it is noisy. The checks rely on the "
               "step and slot counts, which do not depend on the machine.")


if __name__ == "__main__":
    sys.exit(main(globals()))
