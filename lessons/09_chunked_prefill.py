"""Lesson 9: chunked prefill and the token budget — a long prompt split over steps while decodes go on."""
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # `python lessons/NN_x.py` from a checkout

from engine import LLM
from lessons.cli import main
from lessons.framework import greedy, queue_request, queues, table

TITLE = "Chunked prefill and the token budget"
SUMMARY = "A long prompt is split over steps under max_num_batched_tokens while other requests keep decoding."
BLOCK = 16
BUDGET = 64
LONG = 200


def run(lesson) -> None:
    lesson.intro(
        f"Each step has one **token budget**, `max_num_batched_tokens` (here {BUDGET}), shared by every "
        "request in the batch. There are no separate prefill and decode phases: a decoding request asks "
        "for 1 token, a request still reading its prompt asks for the rest of it, and the scheduler hands "
        "out the budget — running requests first, then new ones. A prompt longer than what is left is "
        "**split into chunks** over several steps (chunked prefill, on by default in vLLM V1). You will "
        f"send a {LONG}-token prompt while two short requests are decoding, and watch each step's budget.")
    llm, session = lesson.engine(block_size=BLOCK, num_kv_blocks=64, max_num_batched_tokens=BUDGET)
    engine = llm.llm_engine
    sub = session.bus.subscribe()

    a, b, long = _a_long_prompt_arrives(lesson, llm, sub)
    lesson.pause()

    steps = _prefill_in_chunks(lesson, engine, sub, long)
    _chunks_share_the_budget_with_decodes(lesson, steps)
    lesson.pause()

    while engine.has_unfinished_requests():
        engine.step()
    lesson.check(a.num_output_tokens == b.num_output_tokens == 12 and long.num_output_tokens == 3,
                 "all three requests finished with their full output")

    _without_chunked_prefill_it_is_refused(lesson)
    lesson.done("One token budget per step covers prefill and decode alike. Running requests are served first, "
                "so decodes keep flowing; a long prompt takes what is left, chunk by chunk, and only its last "
                "chunk samples a token. The budget bounds how much work — and so how much time — one step "
                "can take, which keeps the gap between a decoding request's tokens short.")


def _a_long_prompt_arrives(lesson, llm, sub) -> tuple:
    """A and B prefill and decode a step; then L arrives with its long prompt. Returns the three requests."""
    engine = llm.llm_engine
    a = queue_request(engine, "A", {"prompt_token_ids": list(range(10))}, greedy(12))
    b = queue_request(engine, "B", {"prompt_token_ids": list(range(50, 60))}, greedy(12))
    engine.step()  # A and B prefill together (20 tokens)
    engine.step()  # both decode
    sub.pull()
    long = queue_request(engine, "L", {"prompt_token_ids": [(7 * j) % 256 for j in range(LONG)]}, greedy(3))
    lesson.say(f"A and B have been decoding for a step. Now **L** arrives with a {LONG}-token prompt.")
    lesson.show(queues(llm))
    lesson.predict(f"With a budget of {BUDGET} tokens per step and two requests decoding, how many steps does "
                   f"L's {LONG}-token prefill take, and how big is each chunk?",
                   f"A and B take 1 token each, leaving {BUDGET - 2} for L: chunks of 62, 62, 62 and then the "
                   f"remaining {LONG - 3 * 62}, so 4 steps.")
    return a, b, long


def _prefill_in_chunks(lesson, engine, sub, long) -> list[dict]:
    """Step until L has its first token; show each step's tokens per request. Returns what each step did."""
    rows, steps = [], []
    while not long.output_token_ids:
        k = engine.engine_core.engine_core.step_count
        engine.step()
        events = sub.pull().events
        snap = next(e.attrs for e in events if (e.layer, e.name, e.kind) == ("scheduler", "schedule", "snapshot"))
        sampler = next(e.attrs for e in events if (e.layer, e.name) == ("sampler", "sampled"))
        sampled_for_l = [e for e in events if (e.layer, e.name, e.request_id) == ("detokenizer", "NEW_TOKENS", "L")]
        per = {s["request_id"]: s for s in snap["scheduled"]}
        steps.append(dict(step=k, per=per, used=snap["total_num_scheduled_tokens"], budget=snap["token_budget"],
                          l_tokens=len(sampled_for_l), l_in_sampler="L" in sampler["request_ids"]))
        rows.append([k] + [f"{per[r]['num_tokens']}{per[r]['kind'][0]}" if r in per else "—" for r in "ABL"]
                    + [f"{snap['total_num_scheduled_tokens']} / {snap['token_budget']}",
                       f"{long.num_computed_tokens} / {LONG}",
                       long.output_token_ids[0] if long.output_token_ids else "none yet"])
    lesson.show(table(["step", "A", "B", "L", "budget used", "L computed", "L's first token"], rows,
                      title="tokens per request per step (p = prefill, d = decode), from the trace"))
    return steps


def _chunks_share_the_budget_with_decodes(lesson, steps: list[dict]) -> None:
    chunks = [s["per"]["L"]["num_tokens"] for s in steps]
    lesson.check(chunks == [62, 62, 62, LONG - 3 * 62],
                 f"L's prompt went in {len(chunks)} chunks, {' + '.join(map(str, chunks))} = {sum(chunks)} tokens")
    lesson.check(sum(chunks) == LONG, "the chunks add up to exactly the prompt length")
    lesson.check([s["per"]["L"]["num_computed_before"] for s in steps] == [0, 62, 124, 186],
                 "each chunk starts where the previous one ended (its KV is already in the cache)")
    lesson.check(all(s["per"][r]["kind"] == "decode" and s["per"][r]["num_tokens"] == 1 for s in steps for r in "AB"),
                 "A and B decoded one token in every step of L's prefill: the long prompt did not stall them")
    lesson.check(all(s["used"] <= s["budget"] == BUDGET for s in steps) and
                 all(s["used"] == BUDGET for s in steps[:-1]),
                 f"no step went over the {BUDGET}-token budget; the full-chunk steps used all of it")
    lesson.check([s["l_tokens"] for s in steps] == [0] * (len(steps) - 1) + [1],
                 "L got no token until its last chunk; that step produced its first token")
    lesson.say("Why no token earlier? The model does compute logits for L's last position in every step, "
               "but after a partial chunk that position is in the middle of the prompt: the next token is "
               "already known (it is the prompt), so the engine throws the sample away.")
    lesson.check(all(s["l_in_sampler"] for s in steps),
                 "the sampler did run for L in every one of those steps; only the last sample was kept")


def _without_chunked_prefill_it_is_refused(lesson) -> None:
    lesson.say("Turn chunked prefill off and the scheduler must fit a whole prompt into one step. A prompt "
               "longer than the budget could then never be scheduled, so this engine refuses it when it is "
               "added. (vLLM itself checks this at startup: with chunked prefill off it requires "
               "`max_num_batched_tokens >= max_model_len`.)")
    llm_off = LLM(model=lesson.model, block_size=BLOCK, num_kv_blocks=64, max_num_batched_tokens=BUDGET,
                  enable_chunked_prefill=False, async_scheduling=False)
    try:
        llm_off.llm_engine.add_request("L", {"prompt_token_ids": [1] * LONG}, greedy(3))
        refused = ""
    except ValueError as e:
        refused = str(e)
    lesson.show(refused or "(accepted)", title="chunked prefill off")
    lesson.check("chunked prefill is off" in refused,
                 f"without chunked prefill a {LONG}-token prompt does not fit a {BUDGET}-token budget and is refused")


if __name__ == "__main__":
    sys.exit(main(globals()))
