"""Lesson 24: the worker's side of the step — what the scheduler sends, and what the worker keeps."""
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # `python lessons/NN_x.py` from a checkout

from engine.core.sched.output import diff_summary
from lessons.cli import main
from lessons.framework import greedy, table

TITLE = "The worker's side of the step"
SUMMARY = ("What the SchedulerOutput tells the workers: a request whole once (NewRequestData), then only its new "
           "blocks (CachedRequestData); the slot it holds in the worker's persistent batch; what a preemption and "
           "a resumption send.")
BLOCK = 4
PROMPT = [11, 12, 13, 14, 15, 16]  # six tokens: two blocks of four, the second with room for two more


def _record_schedules(core) -> list:
    """Every SchedulerOutput the core hands its executor, in order (the lesson peeks; the engine is unchanged)."""
    sent, schedule = [], core.scheduler.schedule

    def recording(*args, **kwargs):
        out = schedule(*args, **kwargs)
        sent.append(out)
        return out

    core.scheduler.schedule = recording
    return sent


def _new_row(n) -> list:
    return [n.req_id, len(n.prompt_token_ids), len(n.prefill_token_ids), " ".join(map(str, n.block_ids[0])),
            n.num_computed_tokens, n.seed]


def _cached_rows(out) -> list[list]:
    c = out.scheduled_cached_reqs
    return [[out.step, rid, "-" if blocks is None else " ".join(map(str, blocks[0])), computed, outputs]
            for rid, blocks, computed, outputs in zip(c.req_ids, c.new_block_ids, c.num_computed_tokens,
                                                      c.num_output_tokens)]


def run(lesson) -> None:
    lesson.intro(
        "vLLM 0.33's model runner (Model Runner V2, `vllm/v1/worker/gpu/`) keeps every running request's state "
        "in the **worker**: its tokens, its block table and its sampling settings, each in a *slot* of a "
        "persistent batch (`RequestState`, `BlockTables`). So the scheduler sends a **diff** each step "
        "(`vllm/v1/core/sched/output.py`): a request comes whole the first time, as a `NewRequestData`; "
        "afterwards it is one entry of `CachedRequestData`: how many tokens are computed and the blocks it "
        "gained, if any. That small message is what lets one `SchedulerOutput` go to every tensor-parallel "
        "rank. This lesson records the messages of a real run and reads the worker's slots beside them.")
    # (the lessons' engines step synchronously: one whole step per call; async scheduling sends the same messages)
    llm, _ = lesson.engine(block_size=BLOCK, num_kv_blocks=64)
    engine = llm.llm_engine
    core = engine.engine_core.engine_core
    runner = core.model_executor.worker.model_runner
    sent = _record_schedules(core)

    engine.add_request("A", {"prompt_token_ids": PROMPT}, greedy(6))
    engine.step()
    first = sent[-1]
    [new] = first.scheduled_new_reqs
    lesson.show(table(["request", "prompt", "tokens to compute", "block ids", "computed", "seed"], [_new_row(new)],
                      title=f"step {first.step}: NewRequestData (the whole request)"))
    lesson.check(new.req_id == "A" and new.prompt_token_ids == PROMPT and new.num_computed_tokens == 0
                 and len(new.block_ids[0]) == 2,
                 "the first time A runs it is sent whole: its prompt, its sampling settings, its two blocks, and "
                 "its seed (every request gets one; the sampler keys each draw by (seed, position))")
    while engine.has_unfinished_requests():
        engine.step()
    later = [s for s in sent[1:] if "A" in s.num_scheduled_tokens]
    rows = [row for s in later for row in _cached_rows(s)]
    lesson.show(table(["step", "request", "new block ids", "computed", "output tokens"], rows,
                      title="later steps: CachedRequestData (a diff)"))
    gained = [s.step for s in later if s.scheduled_cached_reqs.new_block_ids[0] is not None]
    lesson.check(all(not s.scheduled_new_reqs for s in later) and len(gained) == 1,
                 f"afterwards A is only a diff: no tokens (the worker keeps the ones it sampled), and a block id "
                 f"only at step {gained[0] if gained else '?'}, when position 8 needed a third block")
    sizes = [diff_summary(s)["num_bytes"] for s in (first, later[0])]
    lesson.check(sizes[1] < sizes[0], f"the diff is smaller on the wire: {sizes[1]} bytes against {sizes[0]} "
                                      "for the whole request (msgpack, as tensor-parallel ranks receive it)")
    lesson.pause()
    _slots(lesson, engine, runner, sent)
    lesson.pause()
    _preemption(lesson)
    lesson.done(
        "The scheduler sends diffs: a request whole once (NewRequestData), then its computed count and new "
        "blocks (CachedRequestData). The worker keeps each request in a slot (tokens, block table, seed) and "
        "builds every step's inputs from the slots. A preempted request loses its slot and comes back whole, "
        "with every token to compute again; a finished one frees its slot for the next request.")


def _slots(lesson, engine, runner, sent) -> None:
    lesson.say("**Slots.** Two requests at once: each takes a free slot in the worker's `RequestState`, whose "
               "row holds its tokens; `BlockTables` holds its block table in the same row. A step's inputs are "
               "gathered from these rows by slot (`idx_mapping`), by the input kernels of lesson 6.")
    engine.add_request("B", {"prompt_token_ids": [21, 22, 23]}, greedy(6))
    engine.add_request("C", {"prompt_token_ids": [31, 32, 33, 34, 35]}, greedy(6))
    engine.step()
    engine.step()
    states, tables = runner.req_states, runner.block_tables
    core = engine.engine_core.engine_core
    rows = []
    for rid in ("B", "C"):
        slot, req = states.req_id_to_index[rid], core.requests[rid]
        held = states.token_ids[slot, :states.num_tokens[slot]].tolist()
        row = tables.block_tables[slot, :tables.num_blocks[slot]].tolist()
        rows.append([rid, slot, " ".join(map(str, held)), " ".join(map(str, row)), " ".join(map(str, req.block_ids))])
    lesson.show(table(["request", "slot", "tokens in the slot", "worker's block table", "scheduler's block table"],
                      rows, title="the worker's persistent batch after two steps"))
    lesson.check(all(r[3] == r[4] for r in rows) and rows[0][1] != rows[1][1],
                 "each request has its own slot, and the worker's block table row equals the scheduler's: the "
                 "diffs added up")
    lesson.check(all(r[2].split() == [str(t) for t in core.requests[r[0]].all_token_ids] for r in rows),
                 "the slot holds the prompt and every token sampled so far: the worker appended its own samples")
    while engine.has_unfinished_requests():
        engine.step()
    held = sorted(states.req_id_to_index)
    engine.add_request("D", {"prompt_token_ids": [41, 42]}, greedy(2))
    engine.step()
    lesson.check(held == ["B", "C"] and sent[-1].finished_req_ids == {"B", "C"} and
                 set(states.req_id_to_index) == {"D"},
                 "B and C finished, yet the worker still held their slots: it learns of a finish from the next "
                 "step's finished_req_ids, and only then frees them")
    lesson.check(states.req_id_to_index["D"] in (rows[0][1], rows[1][1]),
                 f"D took one of the freed slots: slot {states.req_id_to_index['D']}")
    while engine.has_unfinished_requests():
        engine.step()


def _preemption(lesson) -> None:
    lesson.say("**Preemption.** When blocks run out, the scheduler preempts a request and names it in "
               "`preempted_req_ids`. Model Runner V2 drops it from its slots, like a finished one; when it runs "
               "again it is sent whole once more, a `NewRequestData` whose `prefill_token_ids` are its prompt "
               "*and* the tokens it had generated: all of them are computed again.")
    tight, _ = lesson.engine(block_size=BLOCK, num_kv_blocks=9, enable_prefix_caching=False)
    engine = tight.llm_engine
    core = engine.engine_core.engine_core
    sent = _record_schedules(core)
    prompts = {"P": list(range(40, 52)), "Q": list(range(60, 72))}
    for rid, ids in prompts.items():
        engine.add_request(rid, {"prompt_token_ids": ids}, greedy(16))
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    at = next(s for s in sent if s.preempted_req_ids)
    [victim] = at.preempted_req_ids
    back = next(n for s in sent[sent.index(at) + 1:] for n in s.scheduled_new_reqs if n.req_id == victim)
    lesson.show(table(["request", "prompt", "tokens to compute", "block ids", "computed", "seed"], [_new_row(back)],
                      title=f"{victim} preempted at step {at.step}, and sent whole again"))
    lesson.check(len(back.prefill_token_ids) > len(prompts[victim]) and back.num_computed_tokens == 0
                 and back.prefill_token_ids[:len(prompts[victim])] == prompts[victim],
                 f"{victim} came back as a NewRequestData: its {len(prompts[victim])}-token prompt and the "
                 f"{len(back.prefill_token_ids) - len(prompts[victim])} tokens it had generated, none computed")
    roomy, _ = lesson.engine(block_size=BLOCK, num_kv_blocks=64)
    alone = roomy.generate([{"prompt_token_ids": ids} for ids in prompts.values()], greedy(16), use_tqdm=False)
    lesson.check([outs[rid] for rid in prompts] == [o.outputs[0].token_ids for o in alone],
                 "and the tokens are the same as without a preemption: recomputing gives the same K/V")


if __name__ == "__main__":
    sys.exit(main(globals()))
