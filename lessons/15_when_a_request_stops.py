"""Lesson 15: when a request stops — EOS, stop strings, stop tokens, min/max tokens, abort,
penalties and logprobs, each checked on the live engine (and, for abort, a live server)."""
import collections
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # `python lessons/NN_x.py` from a checkout

import httpx
from rich.markup import escape

from engine import SamplingParams
from engine.engine.async_llm import AsyncLLM
from engine.entrypoints.openai import build_app
from engine.entrypoints.openai.background import start_background
from engine.entrypoints.openai.serving import StopHoldback
from lessons.cli import main
from lessons.framework import events_of, queue_request, table

TITLE = "When a request stops"
SUMMARY = "EOS, stop strings (held back while streaming), stop_token_ids, min/max_tokens, abort, penalties, logprobs."
PROMPT = "The cat sat on the"
EOS_PROMPTS = ["Once upon a time", "Hello, my name is", "The end."]
N = 24  # tokens per greedy run


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, **kw)


class Runner:
    """One request at a time through the lesson's engine, keeping every step's output."""

    def __init__(self, engine):
        self.engine, self.k = engine, 0

    def __call__(self, params: SamplingParams, prompt: str = PROMPT) -> tuple:
        return self.many([(params, prompt)])[0]

    def many(self, runs: list[tuple[SamplingParams, str]]) -> list[tuple]:
        """Several requests in one batch, to take fewer steps: per request, its final output and
        its text after every step."""
        rids = []
        for params, prompt in runs:
            self.k += 1
            rids.append(f"r{self.k}")
            self.engine.add_request(rids[-1], prompt, params)
        steps = {rid: [] for rid in rids}
        while any(not (s and s[-1].finished) for s in steps.values()):
            for o in self.engine.step():
                steps[o.request_id].append(o)
        return [(steps[r][-1].outputs[0], [s.outputs[0].text for s in steps[r]]) for r in rids]


def run(lesson) -> None:
    lesson.intro(
        "A request leaves the running batch for one of a few reasons, checked after every token it "
        "samples: it reached **max_tokens** (or the model's context), it produced **EOS** or one of its "
        "**stop_token_ids**, its text now contains a **stop string**, or its client went away (**abort**). "
        "The first gives `finish_reason` *length*, the next two *stop*. You will trigger each on the live "
        "engine, see how a stream holds back text that may turn into a stop string, and finish with what "
        "shapes the tokens on the way: penalties and logprobs.")
    llm, session = lesson.engine(num_kv_blocks=64, enable_prefix_caching=False)
    engine, tok = llm.llm_engine, llm.llm_engine.tokenizer
    gen = Runner(engine)

    # ---- max_tokens ----
    base, base_texts = max_tokens_and_the_context_limit(lesson, engine, tok, gen)
    lesson.pause()

    # ---- EOS ----
    eos_ends_a_request(lesson, engine, tok, gen)
    lesson.pause()

    # ---- stop_token_ids and min_tokens ----
    stop_token_ids_and_min_tokens(lesson, tok, gen, base)
    lesson.pause()

    # ---- stop strings, and what a stream holds back ----
    i, stop, s_out, s_texts = stop_string_cuts_the_text(lesson, gen, base, base_texts)
    stream_holds_back_a_stop_prefix(lesson, i, stop, s_out, s_texts)
    lesson.pause()

    # ---- abort ----
    abort_on_disconnect(lesson)
    lesson.pause()

    # ---- penalties ----
    penalties(lesson, gen, tok)
    lesson.pause()

    # ---- logprobs ----
    logprobs(lesson, gen, tok)
    lesson.done(
        "A request stops on `max_tokens` or the context limit ('length'), on EOS or a stop token id "
        "('stop', the token kept), or on a stop string ('stop', the string cut from the text and held back "
        "while streaming). `min_tokens` keeps EOS and stop tokens from being sampled at all until then. A "
        "client that disconnects aborts its request; its blocks are freed between two steps. Penalties "
        "change the logits before the choice; logprobs report the model's raw distribution.")


def max_tokens_and_the_context_limit(lesson, engine, tok, gen) -> tuple:
    """A greedy run to max_tokens, and the limit without one: (that run's output, its text after every step)."""
    base, base_texts = gen(greedy(max_tokens=N, ignore_eos=True))
    lesson.predict(f"Greedy, `max_tokens={N}`, `ignore_eos=True`. How many tokens, and which finish_reason?",
                   f"{N} tokens, finish_reason 'length': nothing else may stop it.")
    lesson.show(table(["token ids", "text", "finish_reason"],
                      [[" ".join(map(str, base.token_ids[:12])) + " …", escape(repr(base.text)), base.finish_reason]]))
    lesson.check(len(base.token_ids) == N and base.finish_reason == "length" and base.stop_reason is None,
                 f"{N} tokens, finish_reason 'length', no stop_reason")
    ids = tok.encode(PROMPT)
    unlimited = queue_request(engine, "unlimited", PROMPT, greedy(max_tokens=None))
    engine.abort_request(["unlimited"])
    lesson.check(unlimited.max_tokens == engine.max_model_len - len(ids),
                 f"without max_tokens a request may run to the context limit: max_model_len {engine.max_model_len} "
                 f"− {len(ids)} prompt tokens = {unlimited.max_tokens} (then 'length' too)")
    return base, base_texts


def eos_ends_a_request(lesson, engine, tok, gen) -> None:
    eos = engine.engine_core.engine_core.eos_token_id
    lesson.say(f"**EOS.** The model's end-of-sequence token is id {eos} ({escape(repr(tok.decode([eos])))}). "
               "Unless `ignore_eos` is set, sampling it ends the request with 'stop' and no stop_reason. "
               f"Three prompts, greedy, up to 40 tokens, with `logprobs=20` to see how likely EOS was:")
    rows, ended = [], []
    for p, (out, _) in zip(EOS_PROMPTS, gen.many([(greedy(max_tokens=40, logprobs=20), p) for p in EOS_PROMPTS])):
        in_top = sum(1 for entry in out.logprobs if eos in entry)
        rows.append([escape(repr(p)), len(out.token_ids), out.finish_reason, repr(out.stop_reason),
                     f"{in_top} of {len(out.logprobs)}"])
        if out.finish_reason == "stop":
            ended.append((p, out))
    lesson.show(table(["prompt", "tokens", "finish_reason", "stop_reason", "steps with EOS in the top 20"], rows))
    if ended:
        p, out = ended[0]
        lesson.check(all(o.token_ids[-1] == eos and o.stop_reason is None for _, o in ended),
                     f"{len(ended)} request(s) ended on EOS (id {eos}): finish_reason 'stop', stop_reason None")
        more, _ = gen(greedy(max_tokens=len(out.token_ids) + 8, ignore_eos=True), prompt=p)
        lesson.check(len(more.token_ids) == len(out.token_ids) + 8 and more.finish_reason == "length",
                     f"with ignore_eos=True the same prompt ({p!r}) runs on to max_tokens")
    else:
        lesson.say(
            "None of them produced EOS: this built-in model puts little probability on it (see the last "
            "column), so greedy decoding never picks it and the requests ran to max_tokens. A model trained "
            "on documents that end with EOS produces it at the end of a text; the rule is the same one that "
            "`stop_token_ids` uses, shown next.")
        lesson.check(all(r[2] == "length" for r in rows), "all three ran to max_tokens: finish_reason 'length'")


def stop_token_ids_and_min_tokens(lesson, tok, gen, base) -> None:
    t = base.token_ids[4]
    k = base.token_ids.index(t)  # its first occurrence
    lesson.predict(f"The greedy run above produced token {t} ({escape(repr(tok.decode([t])))}) first as output "
                   f"token {k + 1}. Same request with `stop_token_ids=[{t}]`: how many tokens come back?",
                   f"{k + 1}: the stop token itself is generated and kept in token_ids; finish_reason 'stop', "
                   f"stop_reason {t}.")
    m = k + 3
    (out, _), (held, _) = gen.many([(greedy(max_tokens=N, ignore_eos=True, stop_token_ids=[t]), PROMPT),
                                    (greedy(max_tokens=N, ignore_eos=True, stop_token_ids=[t], min_tokens=m), PROMPT)])
    lesson.check(out.token_ids == base.token_ids[:k + 1] and out.finish_reason == "stop" and out.stop_reason == t,
                 f"it stopped on token {t} after {k + 1} tokens: finish_reason 'stop', stop_reason {t}")
    lesson.predict(f"Now also `min_tokens={m}`. Below min_tokens vLLM V1 sets the logits of EOS and every stop "
                   f"token to −∞. What does greedy pick at output token {k + 1}?",
                   f"Its second choice: token {t} cannot be generated before output {m}, so the text changes "
                   f"from there on (rather than emitting {t} and ignoring it).")
    lesson.show(table(["run", "token ids", "finish_reason", "stop_reason"], [
        ["no stop tokens", " ".join(map(str, base.token_ids[:m + 2])) + " …", base.finish_reason, "None"],
        [f"stop_token_ids=[{t}]", " ".join(map(str, out.token_ids)), out.finish_reason, repr(out.stop_reason)],
        [f"… and min_tokens={m}", " ".join(map(str, held.token_ids[:m + 2])) + " …", held.finish_reason,
         repr(held.stop_reason)]]))
    lesson.check(held.token_ids[:k] == base.token_ids[:k] and held.token_ids[k] != t and t not in held.token_ids[:m],
                 f"with min_tokens={m}, token {t} is not among the first {m} outputs: the same tokens up to "
                 f"output {k}, then the next best")
    lesson.check(held.finish_reason == ("stop" if t in held.token_ids else "length"),
                 f"after that it finished with '{held.finish_reason}'"
                 + (f" on a later {t}" if t in held.token_ids else f" ({t} did not come again)"))


def stop_string_cuts_the_text(lesson, gen, base, base_texts) -> tuple:
    """A stop string split across two tokens: (the token it starts in, the string, the output, its text per step)."""
    full = base.text
    cut = boundary_stop(base_texts)
    lesson.check(cut is not None, "the greedy text has two characters split across two tokens, to use as a stop string")
    i, stop = cut
    at = full.find(stop)
    lesson.predict(f"Stop string {escape(repr(stop))}: its first character ends output token {i + 1}, its second "
                   f"starts token {i + 2}. What is the final text, and how many tokens were generated?",
                   f"{escape(repr(full[:at]))}: the text up to the stop string, which is cut out. {i + 2} tokens: the "
                   "match is only seen once the token that completes it has been generated.")
    (s_out, s_texts), (inc, _) = gen.many([
        (greedy(max_tokens=N, ignore_eos=True, stop=[stop]), PROMPT),
        (greedy(max_tokens=N, ignore_eos=True, stop=[stop], include_stop_str_in_output=True), PROMPT)])
    lesson.check(s_out.text == full[:at] and s_out.finish_reason == "stop" and s_out.stop_reason == stop,
                 f"text {s_out.text!r}, finish_reason 'stop', stop_reason {stop!r}")
    lesson.check(len(s_out.token_ids) == i + 2, f"{i + 2} tokens were generated; the last one's text was cut")
    lesson.check(inc.text == full[:at + len(stop)], "with include_stop_str_in_output=True the stop string is kept")
    return i, stop, s_out, s_texts


def stream_holds_back_a_stop_prefix(lesson, i: int, stop: str, s_out, s_texts: list[str]) -> None:
    """Replay the stop-string run's texts through StopHoldback, as a stream would, against vLLM's fixed buffer."""
    hold, rows, sent, ours_held = StopHoldback([stop]), [], [], []
    fixed = len(stop) - 1  # vLLM's stop_buffer_length: max(len(s) for s in stop) - 1
    for step, text in enumerate(s_texts):
        last = step == len(s_texts) - 1
        delta = hold.delta(text, finished=last)
        sent.append(delta)
        ours_held.append(len(text) - hold.sent)
        rows.append([step + 1, escape(repr(text)), escape(repr(delta)), escape(repr(text[hold.sent:])),
                     escape(repr(text[len(text) - (0 if last else fixed):]))])
    lesson.say("Streaming: each step the server gets the text so far and sends only what cannot be the start "
               "of a stop string (`StopHoldback` in engine/entrypoints/openai/serving.py). Otherwise it might send the "
               "first character of the stop string and could not take it back. vLLM does it more simply: its "
               "detokenizer always holds back the last `max(len(stop)) − 1` characters while a request with stop "
               "strings streams (`stop_buffer_length` in `BaseIncrementalDetokenizer`, used by "
               "`get_next_output_text`, `vllm/v1/engine/detokenizer.py`), whether or not they could start one. "
               "Ours holds back only a tail that is a prefix of a stop string, so its chunks lag less.")
    lesson.show(table(["step", "text so far", "sent now", "held back", "vLLM would hold back"], rows[max(0, i - 2):],
                      title=f"stop={escape(repr(stop))}: the last steps of the stream"))
    lesson.check(all(h <= fixed for h in ours_held) and any(h < fixed for h in ours_held[:-1]),
                 f"ours never held back more than vLLM's fixed {fixed} character(s), and at some steps less "
                 "(nothing, when the text did not end with the start of the stop string)")
    lesson.check(s_texts[i].endswith(stop[0]) and rows[i][3] == escape(repr(stop[0])),
                 f"after token {i + 1} the text ends with {stop[0]!r}, a prefix of the stop string: "
                 "it was held back")
    lesson.check("".join(sent) == s_out.text, "the chunks sent add up to exactly the final text: nothing to take back")


def logprobs(lesson, gen, tok) -> None:
    lp, _ = gen(greedy(max_tokens=6, ignore_eos=True, logprobs=3))
    rows = []
    for tid, entry in zip(lp.token_ids, lp.logprobs):
        alts = sorted(entry.items(), key=lambda kv: -kv[1].logprob)
        rows.append([escape(repr(tok.decode([tid]))), f"{entry[tid].logprob:.3f}", entry[tid].rank,
                     ", ".join(f"{escape(repr(a.decoded_token))} {a.logprob:.2f}" for _, a in alts[:3])])
    lesson.show(table(["token", "logprob", "rank", "top 3 (logprob)"], rows, title="logprobs=3, greedy"))
    lesson.check(all(e[t].rank == 1 and e[t].logprob <= 0 and len(e) <= 4 for t, e in zip(lp.token_ids, lp.logprobs)),
                 "each entry has the top 3 (plus the chosen token if it is not among them); greedy's choice is rank 1")


def boundary_stop(texts: list[str]) -> tuple[int, str] | None:
    """(i, s): a 2-character string whose first character ends output token i's text and whose
    second starts token i+1's, first seen there in the whole text."""
    full = texts[-1]
    middle_first = list(range(len(texts) // 3, len(texts) - 2)) + list(range(1, len(texts) // 3))
    for i in middle_first:
        piece, nxt = texts[i][len(texts[i - 1]):], texts[i + 1][len(texts[i]):]
        if piece and nxt:
            s = piece[-1] + nxt[0]
            if full.find(s) == len(texts[i]) - 1:
                return i, s
    return None


def abort_on_disconnect(lesson) -> None:
    lesson.say("**Abort.** A client that goes away mid-stream must not leave its request running. The real "
               "server, on a local port: we start a long streamed completion, read three chunks, and hang up.")
    llm, session = lesson.engine(num_kv_blocks=64, enable_prefix_caching=False)
    engine = llm.llm_engine
    async_engine = AsyncLLM.from_engine_core(engine.engine_core.engine_core)
    server, thread, url = start_background(build_app(async_engine, lesson.model))
    max_tokens = min(200, engine.max_model_len - 16)
    try:
        with httpx.Client(base_url=url, timeout=60, trust_env=False) as client:
            body = {"model": lesson.model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
                    "ignore_eos": True, "stream": True}
            chunks = 0
            with client.stream("POST", "/v1/completions", json=body) as resp:
                for line in resp.iter_lines():
                    chunks += line.startswith("data: {")
                    if chunks == 3:
                        break  # leaving the block closes the connection
            deadline = time.monotonic() + 20
            while (engine.has_unfinished_requests() or async_engine.stats.num_running) and time.monotonic() < deadline:
                time.sleep(0.05)
            metrics = client.get("/metrics").text
    finally:
        server.should_exit = True
        thread.join(30)
    events = events_of(session)
    aborted = [e for e in events if (e.layer, e.name) == ("engine", "ABORTED")]
    lesson.check(len(aborted) == 1, "the engine aborted the request when the client hung up")
    rid = aborted[0].request_id
    at = events.index(aborted[0])
    new_tokens = [e for e in events if (e.layer, e.name, e.request_id) == ("detokenizer", "NEW_TOKENS", rid)]
    freed = [j for j, e in enumerate(events) if (e.layer, e.name, e.request_id) == ("block_manager", "free", rid)]
    batches = [j for j, e in enumerate(events) if (e.layer, e.name) == ("model_runner", "batch")]
    later = [j for j in batches if j > at and rid in events[j].attrs["request_ids"]]
    between = [j for j in batches if freed and freed[-1] < j < at]
    lesson.show(table(["", ""], [["request", rid], ["tokens generated before the abort", len(new_tokens)],
                                 ["ABORTED at step boundary", aborted[0].step],
                                 ["blocks freed", events[freed[-1]].attrs["block_ids"] if freed else "—"]]))
    lesson.check(len(new_tokens) < max_tokens, f"it generated {len(new_tokens)} of its {max_tokens} tokens")
    lesson.check(len(freed) == 1 and bool(events[freed[0]].attrs["block_ids"]) and not between and not later,
                 "the abort freed its blocks between two steps (no batch ran in between), and no later step "
                 "scheduled it")
    core = engine.engine_core.engine_core  # the EngineCore behind the InprocClient
    lesson.check(core.kv_cache_manager.num_free_blocks == core.kv_cache_manager.num_usable_blocks,
                 "every block is free again")
    lines = metrics.splitlines()
    ours = next((ln for ln in lines if ln.startswith("vllm_trace:request_abort_total")), "")
    success = [ln for ln in lines if ln.startswith("vllm:request_success_total")]
    lesson.check(ours.endswith(" 1.0") and not any('finished_reason="abort"' in ln for ln in success),
                 "/metrics counts it under a name of our own, vllm_trace:request_abort_total 1, and not in "
                 "vllm:request_success_total")
    lesson.say("vLLM does not count it at all: the front end's `OutputProcessor.abort_requests` "
               "(`vllm/v1/engine/output_processor.py`) drops an aborted request's state without recording its "
               "stats, so `vllm:request_success_total` does not move. The counter above is ours, and its "
               "`vllm_trace:` prefix says so, so that a dashboard built on it is not mistaken for vLLM's.")


def penalties(lesson, gen, tok) -> None:
    lesson.say("**Penalties** change the logits before the choice, using what the request has produced so "
               "far: `presence_penalty` subtracts a fixed amount from every token already in the output, "
               "`frequency_penalty` that amount times its count, and `repetition_penalty` divides positive "
               "logits (multiplies negative ones) of every token seen in the prompt or output.")
    n = 32
    runs = {"none": greedy(max_tokens=n, ignore_eos=True, logprobs=20),
            "presence_penalty=1.5": greedy(max_tokens=n, ignore_eos=True, presence_penalty=1.5, logprobs=20),
            "frequency_penalty=1.0": greedy(max_tokens=n, ignore_eos=True, frequency_penalty=1.0, logprobs=20),
            "repetition_penalty=1.5": greedy(max_tokens=n, ignore_eos=True, repetition_penalty=1.5)}
    outs = {name: out for name, (out, _) in zip(runs, gen.many([(p, PROMPT) for p in runs.values()]))}
    rows = []
    for name, out in outs.items():
        top, count = collections.Counter(out.token_ids).most_common(1)[0]
        rows.append([name, escape(repr(out.text[:36])), len(set(out.token_ids)),
                     f"{escape(repr(tok.decode([top])))} × {count}"])
    lesson.show(table(["penalty", "text", "distinct tokens", "most repeated"], rows, title=f"greedy, {n} tokens"))
    # presence / frequency: the choice is the argmax of (raw logprob − penalty); check it against the top 20
    for name, f, p in (("presence_penalty=1.5", 0.0, 1.5), ("frequency_penalty=1.0", 1.0, 0.0)):
        out, ok, reranked = outs[name], True, 0
        for j, (tid, entry) in enumerate(zip(out.token_ids, out.logprobs)):
            counts = collections.Counter(out.token_ids[:j])
            score = {t: lp.logprob - f * counts[t] - p * (counts[t] > 0) for t, lp in entry.items()}
            ok &= all(score[tid] >= s - 1e-4 for s in score.values())
            reranked += entry[tid].rank != 1
        lesson.check(ok, f"{name}: every chosen token beat each of the raw 20 likeliest, after the penalty "
                         "(logprobs are of the raw distribution, before penalties)")
        if reranked:
            lesson.check(out.token_ids != outs["none"].token_ids,
                         f"{name}: {reranked} chosen token(s) were not the raw favourite (rank > 1), "
                         "so the text changed")
    changed = outs["repetition_penalty=1.5"].token_ids != outs["none"].token_ids
    lesson.say(f"Here repetition_penalty=1.5 {'changed' if changed else 'did not change'} the greedy text. "
               "A penalty does not promise fewer repeats in a short text (compare the 'most repeated' column): "
               "it lowers repeated tokens' scores step by step, and the model's next favourite may itself repeat.")


if __name__ == "__main__":
    sys.exit(main(globals()))
