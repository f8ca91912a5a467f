"""Lesson 10: preemption — out of KV-cache blocks, the newest request is preempted and recomputed."""
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # `python lessons/NN_x.py` from a checkout

from engine import SamplingParams
from lessons.cli import main
from lessons.framework import kv_blocks, queue_request, queues, table

TITLE = "Preemption by recompute"
SUMMARY = "Out of KV-cache blocks: the newest running request is preempted, freed, and recomputed later — same output."
BLOCK = 16
# id -> (prompt length, tokens to generate); admitted in this order
WORKLOAD = {"A": (30, 18), "B": (16, 20), "C": (16, 20), "D": (8, 8)}


def prompt(rid: str) -> dict:
    return {"prompt_token_ids": [(ord(rid) * 13 + j) % 250 for j in range(WORKLOAD[rid][0])]}


def greedy(rid: str) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=WORKLOAD[rid][1], ignore_eos=True)


def traced_step(engine, sub) -> tuple[dict, list]:
    engine.step()
    events = sub.pull().events
    snap = next(e for e in events if (e.layer, e.name, e.kind) == ("scheduler", "schedule", "snapshot"))
    return dict(snap.attrs, step=snap.step), events


def run(lesson) -> None:
    lesson.intro(
        "Requests grow by one token per step, so their KV caches keep needing new blocks. vLLM admits "
        "requests optimistically; when a running request needs a block and none is free, the scheduler "
        "**preempts** a running request. Under the default **FCFS** policy (the only one this engine has) "
        "that is the *most recently admitted* one; under vLLM's `--scheduling-policy priority` it is the "
        "lowest-priority one (largest priority value, latest arrival breaking ties). All its blocks are "
        "freed and it goes "
        "back to the **front** of the waiting queue. vLLM V1 preempts only by **recompute**: nothing is "
        "copied anywhere; when the request is admitted again, its prompt *and the tokens it already "
        "generated* are prefilled again to rebuild its KV cache, and decoding continues where it stopped. "
        "You will fill a tiny cache of 6 usable blocks until that happens.")
    llm, session = lesson.engine(block_size=BLOCK, num_kv_blocks=7, max_num_seqs=3, enable_prefix_caching=False)
    engine, bm = llm.llm_engine, llm.llm_engine.engine_core.engine_core.kv_cache_manager
    sub = session.bus.subscribe()
    reqs = {rid: queue_request(engine, rid, prompt(rid), greedy(rid)) for rid in WORKLOAD}
    lesson.say("Four requests: **A** (30-token prompt), **B** and **C** (16), **D** (8), in that order. "
               "`max_num_seqs=3`, so D waits for a free seat. The cache has 7 blocks of 16 slots; block 0 is "
               "the null block, so 6 can hold tokens.")
    lesson.check(bm.num_free_blocks == 6, "6 blocks are free for requests")

    _three_steps_fill_the_cache(lesson, llm, bm, sub, reqs)
    lesson.pause()
    core = _the_newest_request_is_preempted(lesson, llm, sub, reqs)
    lesson.pause()
    _the_preempted_request_is_recomputed(lesson, engine, sub, reqs, core)
    outputs = _run_to_the_end(engine, reqs)
    _recompute_gives_the_same_output(lesson, outputs)
    lesson.done("When the KV cache runs out, vLLM V1 (FCFS) frees the newest running request's blocks and puts it "
                "back at the front of the queue. Its tokens are kept; its KV cache is rebuilt by one prefill "
                "over prompt + generated tokens when it is admitted again. That costs compute, not correctness: "
                "here the output is the same token for token. On a GPU, prefill and decode kernels may round "
                "differently, so a long greedy output can rarely diverge after a recompute. With prefix caching "
                "on, the recompute can even hit the request's own freed blocks if nobody has reused them yet.")


def _three_steps_fill_the_cache(lesson, llm, bm, sub, reqs) -> None:
    """Steps 0-2 take all 6 blocks; A's next token will need a 3rd block of its own."""
    engine = llm.llm_engine
    for _ in range(3):
        snap, _ = traced_step(engine, sub)
    lesson.show(queues(llm))
    lesson.show(kv_blocks(llm), title="the KV cache after step 2 (letter = owner)")
    lesson.check(bm.num_free_blocks == 0 and snap["admitted"] == [] and not snap["preempted"],
                 "after 3 steps all 6 blocks are taken and nobody has been preempted yet")
    a = reqs["A"]
    lesson.check(a.num_computed_tokens == 32 and len(a.block_ids) == 2,
                 "A has filled its 2 blocks exactly (32 tokens): its next token needs a 3rd block")
    lesson.predict("In step 3, A needs a new block and none is free. Which request loses its blocks?",
                   "C: under FCFS, the most recently admitted running request, even though A is the one asking. "
                   "(Had A itself been the newest, A would have been preempted.)")


def _the_newest_request_is_preempted(lesson, llm, sub, reqs):
    """Step 3: C, the newest running request, loses its blocks and goes back to the front of the queue.
    Returns the EngineCore."""
    engine = llm.llm_engine
    a, c = reqs["A"], reqs["C"]
    c_tokens_before = list(c.output_token_ids)
    c_blocks_before = list(c.block_ids)
    snap, events = traced_step(engine, sub)
    pre = [e for e in events if (e.layer, e.name) == ("scheduler", "PREEMPTED")]
    lesson.show(table(["request", "reason (from the trace)"], [[e.request_id, e.attrs["reason"]] for e in pre],
                      title="step 3: PREEMPTED events"))
    lesson.show(queues(llm))
    lesson.check(snap["preempted"] == ["C"] and [e.request_id for e in pre] == ["C"],
                 "step 3 preempted exactly one request, C, the newest running one")
    core = engine.engine_core.engine_core  # the EngineCore behind the InprocClient
    lesson.check(engine.config.scheduler.policy == "fcfs" and [r.request_id for r in core.scheduler.running]
                 == sorted(r.request_id for r in core.scheduler.running),
                 "under the default FCFS policy running stays in admission order (vLLM V1's `--scheduling-policy "
                 "priority` would instead preempt the lowest priority: vllm/v1/core/sched/scheduler.py, schedule())")
    lesson.check(pre[0].attrs["reason"] == "no free blocks for A",
                 "the reason: A needed a block and none was free (and C was the most recently admitted)")
    lesson.check(c.block_ids == [] and c.num_computed_tokens == 0 and c.status.value == "PREEMPTED",
                 f"C's blocks {c_blocks_before} were freed and its computed-token count reset to 0")
    lesson.check([r.request_id for r in core.scheduler.waiting] == ["C", "D"],
                 "C went back to the front of the waiting queue, ahead of D, which has been waiting since the start")
    lesson.check(c.output_token_ids == c_tokens_before and len(c_tokens_before) == 3,
                 "C keeps the 3 tokens it already generated: they are not generated again")
    lesson.check(len(a.block_ids) == 3 and {s["request_id"] for s in snap["scheduled"]} == {"A", "B"},
                 "A got its 3rd block, and A and B decoded on")
    lesson.check(set(snap["waiting_reasons"].values()) == {"preemption this step"},
                 "in a step that preempted, no waiting request is admitted")
    return core


def _the_preempted_request_is_recomputed(lesson, engine, sub, reqs, core) -> None:
    """Once A finishes, C is admitted again and prefills its prompt and its 3 generated tokens."""
    c = reqs["C"]
    reasons = {}
    while c.status.value != "RUNNING":
        snap, _ = traced_step(engine, sub)
        reasons.setdefault(snap["waiting_reasons"].get("C"), snap["step"])
    k = snap["step"]
    back = next(s for s in snap["scheduled"] if s["request_id"] == "C")
    lesson.say(f"C waited (reasons seen: {', '.join(repr(r) for r in reasons if r)}) until A finished "
               f"and freed its blocks. In step {k} C is admitted again:")
    lesson.show(
        table(
            ["request", "tokens this step", "starting at", "kind"],
            [[s["request_id"], s["num_tokens"], s["num_computed_before"], s["kind"]] for s in snap["scheduled"]],
            title=f"step {k}: the batch",
        )
    )
    lesson.check(
        back["num_tokens"] == WORKLOAD["C"][0] + 3 and back["num_computed_before"] == 0 and back["kind"] == "prefill",
        f"C is recomputed from scratch: its 16 prompt tokens plus its 3 generated tokens = "
        f"{back['num_tokens']} tokens in one prefill",
    )
    lesson.check(
        "not enough free KV-cache blocks" in reasons, "while it waited, the reason was the lack of free blocks"
    )
    lesson.check(c.num_preemptions == 1 and core.stats().num_preemptions == 1,
                 "the engine counted one preemption (C's own counter and the engine's stats)")

    lesson.check(reqs["A"].status.finished and not reqs["B"].status.finished,
                 "C came back once A had finished and freed its blocks (B was still running)")


def _run_to_the_end(engine, reqs) -> dict:
    """Every request's output token ids, once all have finished."""
    while engine.has_unfinished_requests():
        engine.step()
    return {rid: r.output_token_ids for rid, r in reqs.items()}


def _recompute_gives_the_same_output(lesson, outputs) -> None:
    """The same four requests on a cache where nobody is preempted give the same tokens."""
    lesson.say("Does recomputing change the answer? Run the same four requests on a cache large enough "
               "that nobody is ever preempted, and compare (greedy decoding).")
    ref_llm, _ = lesson.engine(block_size=BLOCK, num_kv_blocks=64, enable_prefix_caching=False)
    ref = ref_llm.llm_engine
    for rid in WORKLOAD:
        ref.add_request(rid, prompt(rid), greedy(rid))
    ref_outputs = {}
    while ref.has_unfinished_requests():
        for o in ref.step():
            if o.finished:
                ref_outputs[o.request_id] = o.outputs[0].token_ids
    lesson.show(table(["request", "with preemption (last 8 tokens)", "without", "same"],
                      [[rid, " ".join(map(str, outputs[rid][-8:])), " ".join(map(str, ref_outputs[rid][-8:])),
                        "yes" if outputs[rid] == ref_outputs[rid] else "NO"]
                       for rid in WORKLOAD]))
    lesson.check(ref.engine_core.engine_core.stats().num_preemptions == 0, "the roomy engine preempted nothing")
    lesson.check(outputs["C"] == ref_outputs["C"], "C's output is token for token the same as without preemption")
    lesson.check(outputs == ref_outputs, "so are everybody else's")


if __name__ == "__main__":
    sys.exit(main(globals()))
