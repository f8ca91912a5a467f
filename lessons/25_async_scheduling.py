"""Lesson 25: async scheduling — two batches in flight, placeholders, deferred sampling, a preemption in flight."""
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # `python lessons/NN_x.py` from a checkout

from engine import SamplingParams
from engine.hooks import BEGIN, END
from engine.sampling_params import StructuredOutputsParams
from engine.trace_names import BITMASK, ENGINE, EXECUTE_MODEL, MODEL_RUNNER, PREEMPTED, SCHEDULE, SCHEDULER, STEP
from lessons.cli import main
from lessons.framework import events_of, greedy, table

TITLE = "Async scheduling: two batches in flight"
SUMMARY = ("vLLM's default loop: step N+1 scheduled while step N's forward pass runs, the same workload with it on "
           "and off, placeholder tokens resolving, a grammar deferring its sampling, why a preemption in flight "
           "is safe.")
PROMPTS = [f"Request number {i} says" for i in range(8)]
TOKENS = 16


def timed(llm, prompts, params) -> tuple[float, list]:
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t, [o.outputs[0].token_ids for o in outs]


def spans(events, layer: str, name: str) -> dict[int, list[int]]:
    """step -> [begin ns, end ns] of a span."""
    out: dict[int, list[int]] = {}
    for e in events:
        if (e.layer, e.name) == (layer, name) and e.kind in (BEGIN, END) and not (e.attrs or {}).get("rank"):
            out.setdefault(e.step, [0, 0])[e.kind == END] = e.ts_ns
    return out


def overlap(events) -> tuple[list[int], float]:
    """The steps scheduled while the step before ran its forward pass, and the scheduling time that hid (ns)."""
    sched, forward = spans(events, SCHEDULER, SCHEDULE), spans(events, MODEL_RUNNER, EXECUTE_MODEL)
    over, hidden = [], 0.0
    for n, (fb, fe) in forward.items():
        if n + 1 in sched and sched[n + 1][0] < fe:
            over.append(n + 1)
            hidden += max(0, min(fe, sched[n + 1][1]) - max(fb, sched[n + 1][0]))
    return over, hidden


def run(lesson) -> None:
    lesson.intro(
        "Lessons 1-24 took the step apart one whole step at a time: schedule, run the model, sample, update. "
        "vLLM runs it differently by default on a GPU (`--async-scheduling`; its CPU platform turns it off): "
        "`EngineCore.step_with_batch_queue` schedules step N+1 **while step N's forward pass is still "
        "running**, on the executor's thread. The scheduler cannot know the tokens step N will sample, so it "
        "counts them as **placeholders** (`num_output_placeholders`) and schedules the next decode at their "
        "position; the worker fills in the real token from its own buffer. This lesson runs the same "
        "workload both ways, watches placeholders resolve, a grammar wait for its tokens, and a preemption "
        "happen while a step is in flight.")

    # ---- on and off ----
    params = greedy(TOKENS)
    sync_llm, _ = lesson.engine()  # hand_steps: synchronous, one whole step per call
    async_llm, session = lesson.engine(hand_steps=False, async_scheduling=True)  # (the default with CUDA)
    for llm in (sync_llm, async_llm):  # warmed up alike: the first run of a process pays for torch's start
        timed(llm, PROMPTS[:2], greedy(2))
    first = len(events_of(session))
    t_sync, sync_out = timed(sync_llm, PROMPTS, params)
    t_async, async_out = timed(async_llm, PROMPTS, params)
    lesson.check(sync_out == async_out,
                 f"greedy output is identical token for token with async scheduling on and off "
                 f"({len(PROMPTS)} requests × {TOKENS} tokens)")
    over, hidden = overlap(events_of(session)[first:])
    steps = len(spans(events_of(session)[first:], MODEL_RUNNER, EXECUTE_MODEL))
    lesson.show(table(["", "synchronous", "async scheduling"],
                      [["wall time", f"{t_sync * 1e3:.0f} ms", f"{t_async * 1e3:.0f} ms"],
                       ["steps (both runs)", sync_llm.llm_engine.stats().step, async_llm.llm_engine.stats().step],
                       ["throughput", f"{len(PROMPTS) * TOKENS / t_sync:.0f} tok/s",
                        f"{len(PROMPTS) * TOKENS / t_async:.0f} tok/s"]],
                      title="the same workload, measured on this machine"))
    lesson.check(len(over) > 0,
                 f"{len(over)} of the {steps} steps were scheduled while the step before them ran its forward pass; "
                 f"{hidden / max(1, len(over)) / 1e3:.0f} µs of scheduling per step hid behind the model "
                 f"(async ÷ sync throughput here: {t_sync / t_async:.2f}×)")
    lesson.say("What the overlap can hide is the core's own work (scheduling, the grammar bitmask, "
               "update_from_output) behind the forward pass; what it cannot hide is the forward pass itself. "
               "The larger the model's share of a step, the less there is to gain; on a GPU, where a small "
               "model's forward pass takes about as long as the Python around it, the overlap is what keeps the "
               "GPU busy. On a CPU the forward pass and the core share the cores, so there is little to hide and "
               "the second batch's hand-offs cost: vLLM 0.33 turns async scheduling off there, and so does this "
               "engine unless `--async-scheduling` asks for it. The Step panel of `vllm-trace serve "
               "--async-scheduling` draws the two rows (the core's thread, the forward pass) as they happen.")
    lesson.pause()
    placeholders(lesson)
    deferred_grammar(lesson)
    preemption_in_flight(lesson, params)
    lesson.done(
        "Async scheduling keeps two batches in flight: the core schedules step N+1 against step N's "
        "placeholder tokens while step N's forward pass runs, and a call of `step_with_batch_queue` returns "
        "the older step's outputs. Placeholders become tokens in update_from_output; a request with a grammar "
        "runs its forward pass at once but samples after the step before it (its mask needs those tokens); a "
        "request preempted while its step is in flight keeps that step's token and recomputes it, since the "
        "worker runs steps in order. Greedy output never changes.")


def placeholders(lesson) -> None:
    llm, _ = lesson.engine(async_scheduling=True)  # hand-stepped: one step_with_batch_queue call at a time
    core = llm.llm_engine.engine_core.engine_core
    llm.llm_engine.add_request("p", "Hello there", greedy(3))
    req = core.requests["p"]
    out = core.step_with_batch_queue()
    lesson.check(out.outputs == [] and req.num_output_placeholders == 1 and req.output_token_ids == []
                 and len(core.batch_queue) == 1,
                 "the first call schedules step 0 and returns at once, with no output: its token is a "
                 "placeholder (num_output_placeholders = 1) and step 0 is in the batch queue")
    out = core.step_with_batch_queue()
    got = out.outputs[0].new_token_ids if out.outputs else None
    lesson.check(got is not None and req.output_token_ids == got and req.num_output_placeholders == 1
                 and [s.step for _, s, _ in core.batch_queue] == [1],
                 f"the second call schedules step 1 at the placeholder's position, then waits for step 0: its "
                 f"token {got} resolves the first placeholder, and step 1's is the new one")
    lesson.pause()


def deferred_grammar(lesson) -> None:
    llm, session = lesson.engine(async_scheduling=True)
    core = llm.llm_engine.engine_core.engine_core
    so = StructuredOutputsParams(regex="[ab]{6}")
    llm.llm_engine.add_request("g", "Pick:", SamplingParams(temperature=0, max_tokens=6, structured_outputs=so))
    deferred = []
    while core.has_unfinished_requests():
        core.step_with_batch_queue()
        deferred += [s.step for _, s, _ in core.batch_queue if s.pending_structured_output_tokens]
    events = events_of(session)
    ended = {e.step: e.seq for e in events if (e.layer, e.name, e.kind) == (ENGINE, STEP, END)}
    masked = {e.step: e.seq for e in events if e.name == BITMASK}
    late = [n for n in sorted(set(deferred)) if n - 1 in ended and masked.get(n, 0) > ended[n - 1]]
    lesson.check(bool(deferred) and late == sorted(set(deferred)),
                 f"steps {sorted(set(deferred))} of the grammar request were pending_structured_output_tokens: "
                 "each ran its forward pass at once, but computed its bitmask (and sampled) only after the step "
                 "before it ended, when the grammar had accepted that step's token")
    lesson.pause()


def preemption_in_flight(lesson, params) -> None:
    kw = dict(num_kv_blocks=14, block_size=4)  # too few blocks for every request: some are preempted
    sync_llm, _ = lesson.engine(**kw)
    async_llm, session = lesson.engine(hand_steps=False, async_scheduling=True, **kw)
    _, sync_out = timed(sync_llm, PROMPTS[:4], params)
    _, async_out = timed(async_llm, PROMPTS[:4], params)
    events = events_of(session)
    forward = sorted(spans(events, MODEL_RUNNER, EXECUTE_MODEL).items(), key=lambda kv: kv[1][0])
    lesson.check([n for n, _ in forward] == sorted(n for n, _ in forward)
                 and all(a[1][1] <= b[1][0] for a, b in zip(forward, forward[1:])),
                 f"the executor ran the {len(forward)} forward passes one after another, in step order")
    scheduled = {e.step: set(e.attrs["num_scheduled_tokens"]) for e in events
                 if e.layer == SCHEDULER and e.name == SCHEDULE and e.kind == "snapshot"}
    in_flight = [(e.request_id, e.step) for e in events if e.name == PREEMPTED
                 and e.request_id in scheduled.get(e.step - 1, ())]
    lesson.check(bool(in_flight) and async_out == sync_out,
                 f"{len(in_flight)} preemptions hit a request whose previous step was still in flight (e.g. "
                 f"{in_flight[0][0] if in_flight else '?'} at step {in_flight[0][1] if in_flight else '?'}), and "
                 "the output is still identical to the synchronous run's")
    lesson.say("Why that is safe: the victim's blocks are freed at step N+1's schedule while step N still writes "
               "keys and values into them, but the worker runs steps in order, so step N's writes land before "
               "any later step can reuse those blocks. Step N's token still arrives: update_from_output sees a "
               "request that is no longer running, appends the token without placeholder bookkeeping, and the "
               "recompute prefills it with the rest.")


if __name__ == "__main__":
    sys.exit(main(globals()))
