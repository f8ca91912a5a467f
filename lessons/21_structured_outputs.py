"""Lesson 21: structured outputs — a grammar's bitmask decides which tokens may come next."""
import json
import math
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # `python lessons/NN_x.py` from a checkout

from engine import SamplingParams, StructuredOutputsParams
from engine.trace_names import BITMASK, KERNEL, STEP, STRUCTURED_OUTPUT
from lessons.cli import main
from lessons.framework import events_of, table

TITLE = "Structured outputs"
SUMMARY = ("The same prompt with and without a JSON schema; how many of the 4,096 tokens the grammar's mask "
           "allows at each step; what the mask costs per step; and a schema that forces the model somewhere it "
           "would never go, measured in log-probability.")
PROMPT = "The person, described in one line:"
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12}, "color": {"enum": ["red", "green", "blue"]},
    "age": {"type": "integer", "minimum": 0, "maximum": 120}, "alive": {"type": "boolean"}},
    "required": ["name", "color", "age", "alive"]}
BATCH = 8


def show_token(piece: str) -> str:
    return repr(piece)[1:-1] or "∅"


def run(lesson) -> None:
    lesson.intro(
        "Ask the built-in 1.4 M-parameter model for JSON and it writes prose: it learned Python's documentation, not "
        "JSON. With `SamplingParams(structured_outputs=StructuredOutputsParams(json=schema))` (OpenAI's "
        "`response_format`) the engine core's **StructuredOutputManager** (`engine/structured_output/`, vLLM V1's "
        "`v1/structured_output/`) compiles the schema into a grammar over the model's vocabulary with **xgrammar**, on "
        "a thread beside the engine. Meanwhile the request waits with the status "
        "`WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR` (vLLM 0.33's `RequestStatus` in `vllm/v1/request.py`), and "
        "`Scheduler.schedule` passes over it until its grammar is ready. Every step the scheduler asks each request's "
        "grammar matcher which tokens may come next, as a **bitmask** of one bit per token; the model runner sets "
        "every other logit to -inf (`kernels/apply_token_bitmask.py`) before the sampler runs; after sampling the "
        "matcher accepts the token. EOS is allowed only where the grammar may end.")
    llm, session = lesson.engine()
    engine = llm.llm_engine
    core = engine.engine_core.engine_core
    tok = llm.get_tokenizer()
    vocab = core.model_config.vocab_size

    free, req = _schema_makes_the_answer_parse(lesson, llm, engine, core, tok)
    lesson.pause()

    _mask_step_by_step(lesson, req, tok, vocab)
    lesson.pause()

    # ---- cost ----
    _what_the_mask_costs(lesson)
    lesson.pause()

    # ---- forced ----
    _forced_answer_is_unlikely(lesson, llm, tok, free)
    lesson.done(
        "A structured output is a grammar compiled against the vocabulary (off the engine thread; the request waits as "
        "WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR), a bitmask of allowed tokens per request and step, -inf for the rest "
        "before sampling, and a matcher that accepts each sampled token. It makes any model's output parse, at a small "
        "cost per step; it cannot make a forced answer likely, and a model pushed off its path writes what the schema "
        "allows, not what it knows.")


def _schema_makes_the_answer_parse(lesson, llm, engine, core, tok):
    """The same prompt without and with the schema; returns the free output and the schema's request."""
    free = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0].outputs[0]
    engine.add_request("json", PROMPT, SamplingParams(temperature=0, max_tokens=60,
                                                      structured_outputs=StructuredOutputsParams(json=SCHEMA)))
    req = core.requests["json"]
    statuses = []
    while engine.has_unfinished_requests():
        statuses.append(req.status.value)
        engine.step()
    text = tok.decode(req.output_token_ids, skip_special_tokens=True)
    lesson.show(table(["", "greedy output"], [["no schema", repr(free.text)], ["with the schema", text]],
                      title=f"the same prompt: {PROMPT!r}"))
    try:
        json.loads(free.text)
        free_is_json = True
    except ValueError:
        free_is_json = False
    obj = json.loads(text)
    lesson.check(not free_is_json, "without a schema the model's answer is not JSON")
    lesson.check(set(obj) == set(SCHEMA["properties"]) and obj["color"] in ("red", "green", "blue")
                 and isinstance(obj["age"], int) and 0 <= obj["age"] <= 120 and isinstance(obj["alive"], bool)
                 and len(obj["name"]) <= 12,
                 "with it, the answer parses and follows the schema: every key, the enum, an integer in 0..120, "
                 "a boolean, a name of at most 12 characters")
    lesson.check(statuses[0] == "WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR",
                 f"its first step found it WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR (the grammar compiling), "
                 f"then {statuses[-1]}")
    return free, req


def _mask_step_by_step(lesson, req, tok, vocab: int) -> None:
    """How many tokens the mask allowed at each step of the schema's answer."""
    so = req.structured_output_request
    pieces = [tok.decode([t]) for t in req.output_token_ids]
    rows = [[i, show_token(p), f"{n:,} of {vocab:,}", "the grammar chose" if n == 1 else ""]
            for i, (p, n) in enumerate(zip(pieces, so.num_allowed))]
    lesson.show(table(["token", "text", "allowed by the mask", ""], rows,
                      title=f"the mask, step by step (compiled in {so.compile_s * 1e3:.1f} ms)"))
    forced = sum(n == 1 for n in so.num_allowed)
    lesson.say(f"{forced} of the {len(pieces)} tokens had exactly one allowed token: there the schema, not the "
               "model, wrote the text. Inside the name string almost everything is allowed again, and the model "
               "is free. Text the schema fixes is not always a single token's choice: with byte-level BPE a key "
               "name can be spelled by several token sequences (one character at a time, or in longer pieces), "
               "and the mask allows every token that can still complete it.")
    lesson.check(pieces[-2:] == ["}", tok.eos_token] and so.num_allowed[-2:] == [1, 1],
                 "where the schema leaves one choice the mask allows exactly one token: after the last value "
                 "only '}', after '}' only EOS (the grammar is complete; EOS was not allowed before)")
    lesson.check(max(so.num_allowed) > vocab * 0.9,
                 f"inside a string the mask allows nearly everything ({max(so.num_allowed):,} of {vocab:,})")


def _what_the_mask_costs(lesson) -> None:
    """A batch with and without the schema, timed from the trace: step, bitmask fill and mask kernel."""
    lesson.say(f"**Cost.** The same {BATCH} prompts, greedy, 24 tokens each, with and without the schema; the "
               "trace says how long each step took, how long filling the bitmask took (on the engine thread, "
               "in the scheduler) and how long the mask's kernel took (the PyTorch reference on the CPU).")
    prompts = [f"{PROMPT} {'Mr ' * i}" for i in range(BATCH)]
    timings = {}
    for label, so_params in (("no schema", None), ("schema", StructuredOutputsParams(json=SCHEMA))):
        timings[label] = _time_a_batch(lesson, prompts, so_params)
    lesson.show(table(["", "median step (ms)", "bitmask fill (µs/step)", "mask kernel (µs/step)", "steps"], [
        [k, f"{v[0] / 1e6:.2f}", f"{v[1] / 1e3:.0f}" if v[1] else "-", f"{v[2] / 1e3:.0f}" if v[2] else "-", v[3]]
        for k, v in timings.items()], title=f"{BATCH} requests at once, measured"))
    step_ns, fill_ns, apply_ns, _ = timings["schema"]
    lesson.check(fill_ns > 0 and apply_ns > 0,
                 "with the schema every step filled a bitmask and launched the mask kernel")
    lesson.check(fill_ns + apply_ns < 0.5 * step_ns,
                 f"together they are {100 * (fill_ns + apply_ns) / step_ns:.0f}% of a step: the grammar's work is "
                 "per token of the batch, far less than the model's")


def _time_a_batch(lesson, prompts: list[str], so_params) -> tuple:
    """On a fresh engine: (median step ns, mean bitmask fill ns, mean mask kernel ns, steps) of one measured run."""
    llm2, s2 = lesson.engine()
    llm2.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2, structured_outputs=so_params),
                  use_tqdm=False)  # compiles the grammar (and warms up) before the measured run
    s2.state.update()
    first = len(events_of(s2))
    llm2.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=so_params is None,
                                          structured_outputs=so_params), use_tqdm=False)
    evs = events_of(s2)[first:]
    begins = {e.step: e.ts_ns for e in evs if (e.layer, e.name, e.kind) == ("engine", STEP, "begin")}
    spans = [e.ts_ns - begins[e.step] for e in evs
             if (e.layer, e.name, e.kind) == ("engine", STEP, "end") and e.step in begins]
    fills = [e.attrs["fill_ns"] for e in evs if (e.layer, e.name) == (STRUCTURED_OUTPUT, BITMASK)]
    applies = [e.attrs["duration_ns"] for e in evs if e.layer == KERNEL and e.name.startswith("apply_token")]
    return (sorted(spans)[len(spans) // 2], sum(fills) / max(1, len(fills)),
            sum(applies) / max(1, len(applies)), len(spans))


def _forced_answer_is_unlikely(lesson, llm, tok, free) -> None:
    """A schema that forces an odd answer, scored by the unmasked model against its own greedy answer."""
    lesson.say("**When the grammar and the model disagree.** The mask only removes tokens; it never makes the "
               "model want what is left. A schema that allows a single, unlikely answer still gets it, and the "
               "model's own probabilities say how unlikely: score the forced text with `prompt_logprobs` (the "
               "model without any mask).")
    odd = {"type": "object", "properties": {"species": {"const": "zqxj vwkp"}}, "required": ["species"]}
    forced_out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=30, structured_outputs=
                                                     StructuredOutputsParams(json=odd)), use_tqdm=False)[0].outputs[0]
    prompt_ids = tok.encode(PROMPT)
    forced_ids = [t for t in forced_out.token_ids if t != tok.eos_token_id]
    forced_lp = _score(llm, prompt_ids, forced_ids)
    free_lp = _score(llm, prompt_ids, free.token_ids[:len(forced_ids)])
    worst = min(range(len(forced_ids)), key=forced_lp.__getitem__)
    lesson.show(table(["", "text", "tokens", "log-probability (sum)", "per token"], [
        ["forced by the schema", forced_out.text, len(forced_ids), f"{sum(forced_lp):.1f}",
         f"{sum(forced_lp) / len(forced_ids):.2f}"],
        ["the model's own greedy", tok.decode(free.token_ids[:len(forced_ids)]), len(forced_ids),
         f"{sum(free_lp):.1f}", f"{sum(free_lp) / len(forced_ids):.2f}"]], title="what the unmasked model thinks"))
    lesson.check(json.loads(forced_out.text) == {"species": "zqxj vwkp"}, "the schema got exactly what it allowed")
    lesson.check(sum(forced_lp) < sum(free_lp) - 20,
                 f"the model finds it e^{sum(free_lp) - sum(forced_lp):.0f} times less likely than its own answer; "
                 f"its least likely token {show_token(tok.decode([forced_ids[worst]]))!r} had probability "
                 f"{math.exp(forced_lp[worst]):.1e}")


def _score(llm, prompt_ids: list[int], ids: list[int]) -> list[float]:
    """The unmasked model's log-probability of each of `ids` after the prompt."""
    out = llm.generate({"prompt_token_ids": prompt_ids + ids}, SamplingParams(max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    return [out.prompt_logprobs[len(prompt_ids) + i][t].logprob for i, t in enumerate(ids)]


if __name__ == "__main__":
    sys.exit(main(globals()))
