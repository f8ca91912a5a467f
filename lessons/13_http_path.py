"""Lesson 13: the HTTP path — an OpenAI request through FastAPI, across to the engine-core process and back as SSE."""
import json
import pathlib
import sys
import time
from collections import Counter

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # `python lessons/NN_x.py` from a checkout

import httpx

from engine import Hooks
from engine.arg_utils import engine_config
from engine.engine.async_llm import AsyncLLM
from engine.entrypoints.openai import build_app
from engine.entrypoints.openai.background import start_background
from lessons.cli import main
from lessons.framework import events_of, table
from tracer.journey import TWO_PROCESS_CHAIN, layer_path, missing_links, request_events
from tracer.session import TraceSession

TITLE = "The HTTP path"
SUMMARY = ("An OpenAI request through FastAPI and the serving layer, across to the engine-core process and back "
           "as an SSE stream, traced.")
PROMPT = "The quick brown fox"


def run(lesson) -> None:
    lesson.intro(
        "So far lessons drove `engine.step()` by hand. A server does the same in a loop, behind HTTP. "
        "Here the real OpenAI-compatible app runs on a local port, as `vllm-trace serve` runs it, in **two "
        "processes**. In the API-server process (this one) **FastAPI** parses the request (`http`), the "
        "**serving layer** turns it into sampling parameters and submits it (`api`), and the prompt is "
        "**tokenized** (`tokenizer`); `AsyncLLM` hands the token ids to its `AsyncMPClient`, "
        "and they cross to the **engine-core process** (`ipc`), where `EngineCoreProc`'s busy loop calls "
        "`EngineCore.step()`: `scheduler.schedule()` (KV-cache manager), `model_executor.execute_model()` (model "
        "runner, kernels: the forward pass), `model_executor.sample_tokens()` (sampler), "
        "`scheduler.update_from_output()`. Each step's new token ids come back "
        "(`ipc`), are **detokenized** here by the `OutputProcessor` (`detokenizer`), and the HTTP handler "
        "sends the text as a **server-sent event**. The class names are vLLM V1's (`vllm/v1/engine/`), "
        "in the same files under `engine/engine/`, with one difference in the tokenizing, below. You will "
        "stream one completion, then read its path through the layers, and the two processes, from the trace.")
    lesson.say(
        "**Who tokenizes.** In vLLM 0.33 the serving layer's renderer does: "
        "`OpenAIServingCompletion.render_completion_request` (`vllm/entrypoints/openai/completion/serving.py`) "
        "calls the `OnlineRenderer`, whose `BaseRenderer.render_cmpl_async` (`vllm/renderers/base.py`) stamps "
        "the request's `arrival_time` and tokenizes the prompt; `AsyncLLM.add_request` then hands the rendered "
        "input to `InputProcessor.process_inputs` (`vllm/v1/engine/input_processor.py`), which validates it "
        "and builds the `EngineCoreRequest`. Ours has the same two steps under the same names: `OnlineRenderer` "
        "in `engine/renderers/online_renderer.py` tokenizes, and `InputProcessor.process_inputs` "
        "(`engine/engine/input_processor.py`) builds the request.")
    hooks = Hooks()
    session = TraceSession(hooks, control=False, model=lesson.model)
    lesson.sessions.append(session)
    async_engine = AsyncLLM(engine_config(lesson.model, num_kv_blocks=64, async_scheduling=True), hooks,
                            core_options={"trace": True})
    async_engine.start()  # the engine-core process: a fresh interpreter loads the model, then the handshake
    app = build_app(async_engine, lesson.model)
    server, thread, url = start_background(app)
    try:
        lesson.check(server.ready.is_set(), f"the server is up at {url}")
        lesson.check(async_engine.config.scheduler.async_scheduling,
                     "the engine core schedules asynchronously, as `serve` does by default on a GPU and with "
                     "`--async-scheduling` (lesson 25): its loop "
                     "calls step_with_batch_queue, which schedules step N+1 while step N's forward pass runs and "
                     "returns step N's tokens, so a request's tokens reach its HTTP handler one step behind the "
                     "schedule that made them")
        _lesson_body(lesson, session, url, async_engine.core_pid)
    finally:
        server.should_exit = True
        thread.join(30)
    lesson.check(not thread.is_alive() and not async_engine.is_running and async_engine.engine_core.proc.poll() == 0,
                 "the server shut down cleanly: the HTTP thread has stopped and the engine-core process has exited")
    lesson.done("An OpenAI request is parsed by FastAPI, turned into SamplingParams by the serving layer and "
                "tokenized in the API-server process; its token ids cross to the engine-core process, whose "
                "loop runs the same `step()` you have been calling by hand. After each step the new token ids "
                "of every request come back, are detokenized in the API-server process, and go to their HTTP "
                "handlers, which frame the text as `data:` events. The trace follows one request id from the "
                "HTTP layer down to the kernels and back, across both processes (lesson 17 looks at the "
                "boundary itself).")


def _lesson_body(lesson, session, url: str, core_pid: int) -> None:
    rid, streamed = _stream_then_ask_whole(lesson, url)
    lesson.pause()

    # ---- the request's path through the layers ----
    mine, path, by_layer = _request_in_the_trace(lesson, session, rid)
    _the_process_boundary(lesson, mine, path, by_layer, streamed, core_pid)


def _stream_then_ask_whole(lesson, url: str) -> tuple[str, str]:
    """Stream one completion as SSE, then ask for the same one whole: (request id, streamed text)."""
    body = {"model": lesson.model, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "stream": True}
    lesson.show(json.dumps(body, indent=2), title="POST /v1/completions")
    lesson.pause()
    chunks, rows, t0 = [], [], time.perf_counter()
    with httpx.Client(base_url=url, timeout=60, trust_env=False) as client:  # no proxy for 127.0.0.1
        with client.stream("POST", "/v1/completions", json=body) as resp:
            lesson.check(resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream"),
                         "the answer is 200 with content-type text/event-stream")
            for line in resp.iter_lines():
                if not line:
                    continue  # the blank line that ends each event
                ms = (time.perf_counter() - t0) * 1000
                payload = line.removeprefix("data: ")
                if payload == "[DONE]":
                    rows.append([f"{ms:7.1f}", line, "", ""])
                    chunks.append(payload)
                    continue
                chunk = json.loads(payload)
                choice = chunk["choices"][0]
                rows.append([f"{ms:7.1f}", f"data: {{id: {chunk['id']}, …}}", repr(choice["text"]),
                             choice["finish_reason"] or ""])
                chunks.append(chunk)
        lesson.show(table(["ms", "event", "text", "finish_reason"], rows, title="the SSE stream, as it arrived"))
        events = [c for c in chunks if c != "[DONE]"]
        rid = events[0]["id"]
        streamed = "".join(c["choices"][0]["text"] for c in events)
        lesson.check(chunks[-1] == "[DONE]" and len(events) > 1,
                     f"the text came in {len(events)} events, not all at once, and the stream ended with [DONE]")
        lesson.check(all(c["id"] == rid for c in events) and rid.startswith("cmpl-"),
                     f"every chunk carries the request id {rid}")

        lesson.say("The same request without `stream`: one JSON answer when it is complete.")
        whole = client.post("/v1/completions", json=dict(body, stream=False)).json()
    text = whole["choices"][0]["text"]
    lesson.show(table(["", "text"], [["streamed (chunks joined)", repr(streamed)], ["non-streamed", repr(text)]]))
    lesson.check(streamed == text and whole["usage"]["completion_tokens"] == 12,
                 "the streamed chunks add up to exactly the non-streamed text (greedy, same request)")
    return rid, streamed


def _request_in_the_trace(lesson, session, rid: str) -> tuple[list, list, Counter]:
    """The request's own events, layer by layer: (its events, its layer path, events per layer)."""
    lesson.predict("In the trace, which layer does the streamed request meet first, and which last?",
                   "http both times: the route handler opens a span when the request arrives and closes it "
                   "after the last SSE event, after the engine has long finished with it.")
    all_events = events_of(session)
    mine = request_events(all_events, rid)
    named = {e.layer for e in all_events if e.request_id == rid}
    lesson.check({"engine", "scheduler", "detokenizer"} <= named and not any(
        e.request_id.startswith(rid + "-") for e in all_events if e.request_id),
                 f"our engine and trace know the request by that same id, {rid} (one prompt: no suffix)")
    lesson.say("vLLM 0.33's engine does not: `OpenAIServingCompletion._create_completion` "
               "(`vllm/entrypoints/openai/completion/serving.py`) names prompt *i* of a request `<id>-<i>`, even "
               "when there is only one, and `InputProcessor.assign_request_id` "
               "(`vllm/v1/engine/input_processor.py`, called by `AsyncLLM.add_request`) appends 8 random "
               "characters to that, keeping the id the client knows as `external_req_id` for the outputs. Ours "
               "adds `-<i>` only when a request has several prompts, so that one id can be followed from the SSE "
               "chunk down to the kernels.")
    by_layer = Counter(e.layer for e in mine)
    firsts: dict[str, object] = {}
    for e in mine:
        firsts.setdefault(e.layer, e)
    path = layer_path(mine)
    lesson.show(table(["layer", "events", "first event", "step"],
                      [[layer, by_layer[layer], f"{firsts[layer].name} ({firsts[layer].kind})",
                        "" if firsts[layer].step is None else firsts[layer].step] for layer in dict.fromkeys(path)],
                      title=f"{rid} in the trace, by layer, in the order first met"))
    lesson.say("Some events name the request (`QUEUED`, `cache_miss`, `NEW_TOKENS`, ...). Step-level events — "
               "the model runner's batch, each kernel launch, the sampler — belong to every request scheduled "
               "in that step; `tracer.journey.request_events` collects both.")
    lesson.show(" → ".join(path), title="layer_path (the final layer repeats when the request leaves through it)")
    lesson.check(missing_links(path, TWO_PROCESS_CHAIN) == [],
                 "the request passed " + " → ".join(TWO_PROCESS_CHAIN) + ", in that order")
    return mine, path, by_layer


def _the_process_boundary(lesson, mine: list, path: list, by_layer: Counter, streamed: str, core_pid: int) -> None:
    """Which process each layer ran in, and the request's tokens, step by step, back to the SSE chunks."""
    where = {layer: {(e.attrs or {}).get("pid") for e in mine if e.layer == layer} for layer in path}
    lesson.show(table(["layer", "process"], [[layer, "engine core" if where[layer] == {core_pid} else "API server"]
                                             for layer in dict.fromkeys(path)], title="the process boundary"))
    lesson.check(where["tokenizer"] == where["detokenizer"] == {None} and where["http"] == {None},
                 "tokenizing and detokenizing ran in the API-server process, with HTTP (no core pid on their events)")
    core_layers = ("engine", "scheduler", "model_runner", "kernel", "sampler")
    lesson.check(all(where[layer] == {core_pid} for layer in core_layers),
                 f"the engine, scheduler, model runner, kernels and sampler ran in the engine-core process "
                 f"(pid {core_pid})")
    lesson.check(
        mine[0].layer == "http" and mine[0].kind == "begin" and mine[-1].layer == "http" and mine[-1].kind == "end",
        "its first event is the HTTP handler's begin and its last the handler's end",
    )
    new_tokens = [e for e in mine if (e.layer, e.name) == ("detokenizer", "NEW_TOKENS")]
    sse_chunks = [e for e in mine if (e.layer, e.name) == ("api", "sse_chunk")]
    lesson.check(
        len(new_tokens) == 12 and "".join(e.attrs["text"] for e in sse_chunks) == streamed,
        "12 NEW_TOKENS events from the detokenizer; the api layer's sse_chunk events carry exactly the streamed text",
    )
    steps = sorted({e.step for e in new_tokens})
    lesson.check(len(steps) == 12 and by_layer["kernel"] > 0,
                 f"one token per engine step (steps {steps[0]}–{steps[-1]}), each running real kernels")


if __name__ == "__main__":
    sys.exit(main(globals()))
