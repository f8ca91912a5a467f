"""Lesson 17: two processes — the engine core in its own process, requests and outputs over ZMQ."""
import asyncio
import os
import pathlib
import statistics
import sys
import threading
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # `python lessons/NN_x.py` from a checkout

import msgspec

from engine import LLM, Hooks, SamplingParams
from engine.arg_utils import engine_config
from engine.engine.async_llm import AsyncLLM
from engine.engine.core_types import EngineCoreRequest
from engine.engine.input_processor import wire_params
from lessons.cli import main
from lessons.framework import events_of, greedy, table
from tracer.session import TraceSession
from tracer.tui.measure import stream_load

TITLE = "Two processes"
SUMMARY = "The engine core in its own process, as in vLLM V1: token ids over ZMQ, text made in the API server."
NUM_REQUESTS, MAX_TOKENS = 8, 16
TUI_REQUESTS, TUI_TOKENS, TUI_REPS = 64, 64, 2  # the TUI's cost: ~1 s runs, each setup with and without it


def run(lesson) -> None:
    lesson.intro(
        "`vllm-trace serve` runs two processes, as vLLM V1 does. The **API-server process** parses HTTP, "
        "tokenizes the prompt and turns the engine's token ids back into text (the *output processor*: "
        "incremental detokenization and stop strings). The **engine-core process** runs the busy loop "
        "you have been stepping by hand: scheduler, model runner, kernels, sampler. Between them, two ZMQ "
        "sockets carry msgpack messages: `EngineCoreRequest` (token ids, not text) one way, "
        "`EngineCoreOutputs` (new token ids, finish reasons, stats, and the core's trace events) the "
        "other. You will run the same load in one process and in two, look at a request on the wire, see "
        "which process did what, and measure what the boundary costs per step.")
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = [f"Request {i}: the paged KV cache" for i in range(NUM_REQUESTS)]

    # ---- one process -----------------------------------------------------------------------
    # In both setups the engine steps on a thread of its own, as under `serve` (on a busy machine,
    # torch's threads behave very differently on the main thread and on another one).
    one, one_session = lesson.engine(num_kv_blocks=256)  # synchronous: one step's outputs per call
    _on_a_thread(one.generate, prompts, params, use_tqdm=False)  # a warm-up run: first-use costs are not the point
    since = one_session.bus.next_seq
    t0 = time.perf_counter()
    one_outs = _on_a_thread(one.generate, prompts, params, use_tqdm=False)
    one_s = time.perf_counter() - t0
    one_steps = _step_ms([e for e in events_of(one_session) if e.seq >= since])
    lesson.say("Both engines here schedule synchronously, so that each call's outputs are one step's and the "
               "boundary's cost can be read step by step; that is the default on a CPU, as in vLLM. With CUDA "
               "(or `--async-scheduling`) `serve` schedules asynchronously (lesson 25): the core's loop calls "
               "`step_with_batch_queue`, which schedules step N+1 while step N's forward pass runs and returns "
               "step N's outputs, so what crosses the boundary after a call is the step before the one just "
               "scheduled.")
    one_core = one.llm_engine.engine_core.engine_core
    device = one_core.device.type
    on_cuda = device == "cuda"
    lesson.check(engine_config(lesson.model, device=device).scheduler.async_scheduling == on_cuda
                 and engine_config(lesson.model, device=device, async_scheduling=True).scheduler.async_scheduling
                 and (one_core.batch_queue is None) != on_cuda,
                 f"an engine configured with the defaults schedules {'a' if on_cuda else ''}synchronously on "
                 f"{'CUDA' if on_cuda else 'a CPU'}, as this one does; `async_scheduling=True` turns it on")

    # ---- two processes ---------------------------------------------------------------------
    hooks = Hooks()
    session = TraceSession(hooks, control=False, model=lesson.model)
    lesson.sessions.append(session)
    t_start = time.perf_counter()
    two = LLM(lesson.model, num_kv_blocks=256, hooks=hooks, multiprocess=True, async_scheduling=False)
    started_s = time.perf_counter() - t_start
    try:
        _body(lesson, session, two, one_outs, one_steps, one_s, started_s, prompts, params)
        _tui_cost(lesson, one, one_session, two, session)
    finally:
        two.shutdown()
    lesson.done(
        "The engine core is a process of its own: it receives token ids, steps, and sends back new token "
        "ids with its trace events; the API server tokenizes before and detokenizes after, and finishes a "
        "request on a stop string by telling the core to stop it. Both processes stamp events with the "
        "same monotonic clock, so the tracer merges them into one timeline (each core event says its `pid`). "
        "The price is a message each way per step, measured above; the gain is that the engine's thread "
        "no longer shares an interpreter lock with HTTP, detokenization and the TUI, whose cost you measured "
        "in both setups.")


def _body(lesson, session, two, one_outs, one_steps, one_s, started_s, prompts, params) -> None:
    core_pid = two.llm_engine.engine_core.pid
    lesson.check(core_pid is not None and core_pid != os.getpid(),
                 f"the engine core runs in process {core_pid}; this lesson (the API-server side) is {os.getpid()}")
    events, two_steps = _the_same_load_in_two_processes(lesson, session, two, one_outs, one_steps, one_s, started_s,
                                                        prompts, params)
    lesson.pause()

    # ---- a request on the wire ---------------------------------------------------------------
    _a_request_on_the_wire(lesson, two, events, prompts, params)
    lesson.pause()

    # ---- who did what ---------------------------------------------------------------------------
    _which_process_did_what(lesson, events, core_pid)
    _a_stop_string_found_in_the_api_server(lesson, session, two, params)
    lesson.pause()

    # ---- the boundary's cost per step -------------------------------------------------------------
    _the_boundarys_cost_per_step(lesson, events, two_steps)


def _the_same_load_in_two_processes(lesson, session, two, one_outs, one_steps, one_s, started_s, prompts,
                                    params) -> tuple[list, list[float]]:
    """Run the load again through the core process and compare: (its events, its step times in ms)."""
    two.generate(prompts, params, use_tqdm=False)  # warm-up, as for one process
    since = session.bus.next_seq
    t0 = time.perf_counter()
    two_outs = two.generate(prompts, params, use_tqdm=False)
    two_s = time.perf_counter() - t0
    lesson.check(all(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(one_outs, two_outs)),
                 f"the {len(prompts)} requests got the same greedy tokens in one process and in two")
    tokens = sum(len(o.outputs[0].token_ids) for o in two_outs)
    events = _settled(session, lambda evs: True, since)
    two_steps = _step_ms(events)
    lesson.show(table(["", "one process", "two processes"], [
        ["output tokens/s", f"{tokens / one_s:,.0f}", f"{tokens / two_s:,.0f}"],
        ["engine steps", len(one_steps), len(two_steps)],
        ["median step (ms, in the engine)", f"{statistics.median(one_steps):.2f}",
         f"{statistics.median(two_steps):.2f}"],
        ["startup (s)", "—", f"{started_s:.1f} (a new interpreter imports torch, loads the model)"],
    ], title=f"the same load: {len(prompts)} requests x {params.max_tokens} tokens"))
    lesson.say("On a machine this small, two processes share the same few cores, so neither column is "
               "a promise; what matters is that the work per step is the same engine code either way.")
    return events, two_steps


def _a_request_on_the_wire(lesson, two, events: list, prompts: list[str], params) -> None:
    adds = [e for e in events if (e.layer, e.name) == ("ipc", "send") and e.attrs["type"] == "ADD"]
    ids = two.get_tokenizer().encode(prompts[0])
    req = EngineCoreRequest(adds[0].request_id, ids, wire_params(params), time.monotonic(), prompts[0])
    wire = msgspec.msgpack.encode(req)
    lesson.show(table(["field", "value"], [
        ["request_id", req.request_id], ["prompt_token_ids", " ".join(map(str, ids))],
        ["sampling_params", f"{len(req.sampling_params)} fields (temperature, max_tokens, stop, ...)"],
        ["bytes on the wire", len(wire)], ["first bytes", wire[:24].hex(" ")],
    ], title="an EngineCoreRequest, msgpack-encoded (a msgspec Struct sent as an array: no field names)"))
    lesson.check(msgspec.msgpack.decode(wire, type=EngineCoreRequest) == req,
                 "the bytes decode back to the same EngineCoreRequest in the core")
    lesson.check(len(adds) == len(prompts) and adds[0].attrs["bytes"] == len(wire),
                 f"the trace's ipc layer saw {len(adds)} ADD messages; request {req.request_id}'s was {len(wire)} "
                 "bytes, as encoded here")


def _which_process_did_what(lesson, events: list, core_pid: int) -> None:
    def pids(layer: str) -> set:
        return {(e.attrs or {}).get("pid") for e in events if e.layer == layer}

    lesson.show(table(["layer", "process"], [
        [layer, ", ".join("API server" if p is None else f"engine core ({p})" for p in sorted(pids(layer), key=str))]
        for layer in ("tokenizer", "ipc", "engine", "scheduler", "model_runner", "kernel", "sampler", "detokenizer")
        if pids(layer)], title="which process emitted each layer's events"))
    lesson.check(pids("scheduler") == {core_pid} and pids("sampler") == {core_pid},
                 "scheduling and sampling happened in the engine-core process (their events carry its pid)")
    lesson.check(pids("detokenizer") == {None} and pids("tokenizer") == {None},
                 "tokenizing and detokenizing happened in the API-server process (their events carry no core pid)")


def _a_stop_string_found_in_the_api_server(lesson, session, two, params) -> None:
    """The output processor finds a stop string and tells the core, which finishes the request with 'stop'."""
    stop_prompt = "The first argument is"
    full = two.generate(stop_prompt, params, use_tqdm=False)[0].outputs[0].text
    # a piece of the greedy text that first occurs after its start (the model may repeat itself)
    at, n = next((i, n) for n in range(3, len(full)) for i in range(1, len(full) - n + 1)
                 if full[i:i + n].strip() and full.find(full[i:i + n]) == i)
    stop = full[at:at + n]
    out = two.generate(stop_prompt, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                                  stop=[stop]), use_tqdm=False)[0].outputs[0]
    rid = [e for e in events_of(session) if (e.layer, e.name) == ("ipc", "send")][-1].request_id  # its ADD

    def core_finished(evs) -> bool:  # the core's FINISHED may still be on its way here
        return any((e.layer, e.name, e.request_id) == ("engine", "FINISHED", rid) for e in evs)
    mine = [e for e in _settled(session, core_finished) if e.request_id == rid]
    abort = next((e for e in mine if (e.layer, e.name) == ("ipc", "send") and e.attrs["type"] == "ABORT"), None)
    finished = next((e for e in mine if (e.layer, e.name) == ("engine", "FINISHED")), None)
    lesson.show(table(["", ""], [["stop string", repr(stop)], ["text", repr(out.text)],
                                 ["finish_reason", out.finish_reason]], title="a stop string, found in the API server"))
    lesson.check(out.finish_reason == "stop" and out.text == full[:at],
                 "the output processor found the stop string in the text and cut the output before it")
    lesson.check(abort is not None and abort.attrs.get("finish_reason") == "stop" and finished is not None
                 and abort.seq < finished.seq,
                 "it then sent the core an ABORT message carrying the request id and finish_reason stop, and the "
                 "core finished the request after it")
    lesson.check(finished.attrs["finish_reason"] == "stop" and not any(
        (e.layer, e.name) == ("engine", "ABORTED") for e in mine),
                 "our core records FINISHED with finish_reason 'stop' (never ABORTED): its trace knows why the "
                 "request ended")
    lesson.say("Here we differ from vLLM V1 on purpose. Its front end sends the core only the request ids "
               "(`OutputProcessor.process_outputs` returns them as `reqs_to_abort`, in "
               "`vllm/v1/engine/output_processor.py`), and the core marks them `FINISHED_ABORTED` "
               "(`EngineCore.abort_requests` in `vllm/v1/engine/core.py`, whose TODO says the scheduler does not "
               "need to know why); the reason 'stop' lives only in the API server. In both, the core may run "
               "another step or two before the message arrives, and those tokens are dropped. We send the reason "
               "along so that the core's own trace, and the TUI built on it, shows FINISHED(stop) rather than an "
               "abort the client never asked for.")


def _the_boundarys_cost_per_step(lesson, events: list, two_steps: list[float]) -> None:
    ends = {e.step: e.ts_ns for e in events if (e.layer, e.name, e.kind) == ("engine", "step", "end")}
    recvs = [e for e in events if (e.layer, e.name) == ("ipc", "recv") and e.step in ends]
    lat_us = [(e.ts_ns - ends[e.step]) / 1000 for e in recvs]
    sizes = [e.attrs["bytes"] for e in recvs]
    lesson.show(table(["per step", "median", "max"], [
        ["core step end -> outputs received here (us)", f"{statistics.median(lat_us):.0f}", f"{max(lat_us):.0f}"],
        ["EngineCoreOutputs bytes (tokens + trace events)", f"{statistics.median(sizes):,.0f}", f"{max(sizes):,}"],
    ], title=f"{len(recvs)} steps' outputs over the boundary"))
    lesson.check(len(recvs) == len(two_steps) and all(x > 0 for x in lat_us),
                 "every step's outputs arrived here after that step ended in the core (one clock for both)")


def _tui_cost(lesson, one, one_session, two, session) -> None:
    """The same streamed load with and without the TUI (headless, Requests panel), in each setup."""
    lesson.say("Last, the TUI. `serve` runs it in the API-server process, on the asyncio loop that also "
               "streams the responses. In one process its refreshes take the interpreter lock from the "
               "engine's own thread; in two, the engine core steps in a process of its own. Each setup now "
               f"streams {TUI_REQUESTS} requests of {TUI_TOKENS} tokens without the TUI and with it, "
               f"{TUI_REPS} times, interleaved.")
    tok = two.get_tokenizer()
    workload = [(tok.encode(f"Request {i}: what the TUI costs"), greedy(TUI_TOKENS)) for i in range(TUI_REQUESTS)]
    # the same front end, AsyncLLM, over both: the one-process engine on a thread of its own, the core process
    one_front = AsyncLLM.from_engine_core(one.llm_engine.engine_core.engine_core).start()
    two_front = AsyncLLM(two.llm_engine.config, session.hooks, core_options={"trace": True}).start()
    fronts = {"one process": (one_front, one_session), "two processes": (two_front, session)}
    runs: dict[tuple[str, bool], list] = {(name, tui): [] for name in fronts for tui in (False, True)}

    async def measure() -> None:
        for _ in range(TUI_REPS):
            for name, (front, sess) in fronts.items():
                for tui in (False, True):
                    runs[name, tui].append(await stream_load(front, workload, sess, tui, model=lesson.model))
    try:
        asyncio.run(measure())
    finally:
        one_front.stop(0)
        two_front.stop(0)
    ratio = {name: statistics.median(t.tokens_per_s / o.tokens_per_s for o, t in zip(runs[name, False],
                                                                                     runs[name, True]))
             for name in fronts}
    lesson.show(table(["", "no TUI (tokens/s)", "TUI (tokens/s)", "TUI / no TUI", "TUI refreshes/s"], [
        [name, f"{statistics.median(r.tokens_per_s for r in runs[name, False]):,.0f}",
         f"{statistics.median(r.tokens_per_s for r in runs[name, True]):,.0f}", f"{ratio[name]:.2f}",
         f"{min(r.refresh_hz for r in runs[name, True]):.1f} (lowest)"] for name in fronts],
        title=f"the TUI's cost: {TUI_REQUESTS} streamed requests x {TUI_TOKENS} tokens (medians of {TUI_REPS} runs)"))
    lesson.check(all(r.tokens == TUI_REQUESTS * TUI_TOKENS for rs in runs.values() for r in rs),
                 "every run did the same work: all requests streamed to their last token")
    lesson.check(all(r.refresh_hz > 0 for name in fronts for r in runs[name, True]),
                 "the TUI kept refreshing during every run with it")
    one_cost, two_cost = (1 - ratio["one process"]) * 100, (1 - ratio["two processes"]) * 100
    if two_cost < one_cost - 3:  # percentage points: closer than that is within a short run's scatter
        lesson.say(f"Here the TUI cost {one_cost:.0f} % of the throughput in one process and {two_cost:.0f} % in "
                   "two: its refreshes no longer wait on, or hold up, the engine's thread.")
    else:
        lesson.say(f"Here the TUI cost {one_cost:.0f} % of the throughput in one process and {two_cost:.0f} % in "
                   "two, no clear difference: on a machine this small the two processes and the TUI share the same "
                   "few cores, and runs this short scatter; `python -m benchmarks.two_processes` measures it at "
                   "length.")
    lesson.pause()


def _on_a_thread(fn, *args, **kwargs):
    out = []
    t = threading.Thread(target=lambda: out.append(fn(*args, **kwargs)), name="engine-loop")
    t.start()
    t.join()
    return out[0]


def _settled(session, ready, since: int = 0, timeout: float = 10.0) -> list:
    """The session's events from seq `since`, once ready(events) holds (the core's events arrive
    a moment after the front end has what it needs)."""
    end = time.monotonic() + timeout
    while True:
        evs = [e for e in events_of(session) if e.seq >= since]
        if ready(evs) or time.monotonic() > end:
            return evs
        time.sleep(0.02)


def _step_ms(events) -> list[float]:
    begins = {}
    out = []
    for e in events:
        if (e.layer, e.name) == ("engine", "step"):
            if e.kind == "begin":
                begins[e.step] = e.ts_ns
            elif e.kind == "end" and e.step in begins:
                out.append((e.ts_ns - begins[e.step]) / 1e6)
    return out


if __name__ == "__main__":
    sys.exit(main(globals()))
