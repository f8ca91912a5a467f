"""Lesson 14: reading a trace — record, replay backward and forward, open it in Perfetto."""
import json
import pathlib
import shutil
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # `python lessons/NN_x.py` from a checkout

from engine import SamplingParams
from lessons.cli import main
from lessons.framework import table
from tracer import cli
from tracer.events import read_trace
from tracer.replay import Replay
from tracer.state import snapshot_view
from tracer.tracelog import format_event

TITLE = "Reading a trace"
SUMMARY = "Record a run to JSON lines, replay it backward and forward, and open it in Perfetto."
BLOCK = 16
# step -> requests arriving before it: (id, prompt length, tokens to generate)
ARRIVALS = {0: [("A", 40, 14), ("B", 20, 10)], 2: [("C", 70, 8)], 5: [("D", 12, 6)]}


def queues_table(view: dict, title: str):
    rows = [[q, r["request_id"], r["status"], f"{r['num_computed_tokens']} / {r['num_tokens']}",
             " ".join(map(str, r["block_table"]))] for q in ("running", "waiting") for r in view[q]]
    return table(["queue", "request", "status", "computed / total", "block table"], rows, title=title)


def run(lesson) -> None:
    lesson.intro(
        "Everything the earlier lessons showed came from events on the tracer's bus. With `trace_file` "
        "(`--trace-file` on the command line) a recorder writes every event to a **JSON-lines** file as "
        "the engine runs. A **replay** folds those events back into the engine's visible state, so you "
        "can jump to any step, go back, and go forward again, long after the run. The same file "
        "**exports** to the Chrome trace format that ui.perfetto.dev draws as a timeline.")
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="vllm-trace-lesson14-"))
    try:
        _body(lesson, tmp)
    finally:
        if not lesson.pause_enabled:  # interactive runs keep the files to open them
            shutil.rmtree(tmp, ignore_errors=True)


def _body(lesson, tmp: pathlib.Path) -> None:
    path = tmp / "run.jsonl"
    live, events, preempt = _record_a_run(lesson, path)
    lesson.pause()

    # ---- replay ----
    replay, k = _replay_matches_the_live_engine(lesson, path, events, preempt, live)
    lesson.pause()

    _back_and_forward(lesson, replay, k, live)
    lesson.pause()

    # ---- Perfetto ----
    _export_to_perfetto(lesson, tmp, path, live)
    lesson.done("A trace file is a header and one JSON event per line. Replay folds it into the state at any "
                "step, backward or forward, and that state matches what the live engine held. "
                "`vllm-trace export` turns the same file into a Perfetto timeline: one track per request, "
                "one slice per step, every kernel, and the queue and cache counters.")


def _record_a_run(lesson, path: pathlib.Path) -> tuple[dict, list, object]:
    """Run the engine with a trace file: (the live queues after each step, the file's events, the first preemption)."""
    llm, session = lesson.engine(trace_file=str(path), block_size=BLOCK, num_kv_blocks=10, max_num_batched_tokens=48)
    engine = llm.llm_engine
    live = {}  # step -> the engine's own queues right after that step
    while engine.has_unfinished_requests() or engine.engine_core.engine_core.step_count <= max(ARRIVALS):
        k = engine.engine_core.engine_core.step_count
        for rid, n, m in ARRIVALS.get(k, []):
            engine.add_request(rid, {"prompt_token_ids": [(ord(rid) * 7 + j) % 250 for j in range(n)]},
                               SamplingParams(temperature=0, max_tokens=m, ignore_eos=True))
        engine.step()
        snap = engine.engine_core.engine_core.snapshot()
        live[k] = {q: snap[q] for q in ("waiting", "running")}
    session.close()  # the recorder drains what is left: the file is complete
    lines = path.read_text().splitlines()
    header, events = read_trace(path)
    lesson.say(f"A run of {len(live)} steps with 4 requests (some arriving late, a small cache and a "
               f"48-token budget) wrote **{len(lines)} lines** to `{path.name}`: one header, then one event "
               "per line.")
    lesson.show("\n".join(ln if len(ln) < 200 else ln[:200] + " …" for ln in lines[:1]), title="line 1: the header")
    preempt = next((e for e in events if e.name == "PREEMPTED"), None)
    lesson.show("\n".join(format_event(e) for e in events if e.step == 2 and e.layer not in ("kernel",))[:3000],
                title="step 2's events (kernel launches left out), one per line as [TRACE] text")
    lesson.check(header["schema"] == "vllm-trace" and len(events) == len(lines) - 1,
                 "the file is a header line plus one JSON event per line")
    lesson.check(all(set(json.loads(ln)) == {"seq", "ts_ns", "layer", "name", "kind", "request_id", "step", "attrs"}
                     for ln in lines[1:]), "every event has the same 8 keys: seq, ts_ns, layer, name, kind, "
                                           "request_id, step, attrs")
    return live, events, preempt


def _replay_matches_the_live_engine(lesson, path: pathlib.Path, events: list, preempt, live: dict) -> tuple:
    """Replay to the preemption's step (or step 6) and compare with the live engine: (the replay, that step)."""
    replay = Replay.load(path)
    k = preempt.step if preempt is not None else 6
    recorded = next(e.attrs for e in events if e.kind == "snapshot" and e.step == k)
    lesson.predict(f"Replay goes to step {k} by folding the events up to the end of step {k}. Will its queues "
                   f"and block tables match what the live engine held after step {k}?",
                   "Exactly: each step's schedule snapshot is recorded, and what happened after it in the "
                   "step (computed tokens, new tokens, finishes, frees) is folded on top.")
    state = replay.goto(k)
    view = snapshot_view(state)
    lesson.show(queues_table(view, f"replay at step {k}"))
    if preempt is not None:
        lesson.say(f"Step {k} is where **{preempt.request_id}** was preempted ({preempt.attrs['reason']}).")
    lesson.check(state.step == k and state.snapshot == recorded,
                 f"replay at step {k} holds exactly the schedule snapshot recorded at step {k}")
    lesson.check(view == live[k], f"its queues, token counts and block tables equal the live engine's after step {k}")
    lesson.check(all(snapshot_view(replay.goto(s)) == live[s] for s in live),
                 f"and so do those of every one of the {len(live)} steps")
    return replay, k


def _back_and_forward(lesson, replay, k: int, live: dict) -> None:
    at_k = replay.goto(k).to_dict()
    back1 = replay.prev()
    lesson.show(queues_table(snapshot_view(back1), f"one step back: step {back1.step}"))
    lesson.check(back1.step == k - 1 and snapshot_view(back1) == live[k - 1], f"prev() went back to step {k - 1}")
    replay.prev()
    replay.next()
    fwd = replay.next()
    lesson.check(fwd.step == k and fwd.to_dict() == at_k,
                 f"two steps back and two forward: the whole state at step {k} is the same again")
    lesson.say("Going back is cheap: replay keeps a copy of the state every few steps and folds forward "
               "from the nearest one, so back and forward can never disagree.")


def _export_to_perfetto(lesson, tmp: pathlib.Path, path: pathlib.Path, live: dict) -> None:
    out = tmp / "run.perfetto.json"
    rc = cli.main(["export", str(path), "--format", "perfetto", "-o", str(out)])
    chrome = json.loads(out.read_text())
    evs = chrome["traceEvents"]
    tracks = {e["id"] for e in evs if e["ph"] == "b" and e.get("cat") == "request" and e["name"].startswith("request ")}
    phases = sorted({e["name"] for e in evs if e["ph"] == "b" and e.get("cat") == "request"
                     and not e["name"].startswith("request ")})
    threads = [e["args"]["name"] for e in evs if e["ph"] == "M" and e["name"] == "thread_name"]
    counters = sorted({e["name"] for e in evs if e["ph"] == "C"})
    lesson.show(f"$ vllm-trace export {path.name} --format perfetto -o {out.name}\n\n"
                f"{len(evs)} trace events\n"
                f"async tracks (one per request): {', '.join(sorted(tracks))}; phases {', '.join(phases)}\n"
                f"threads: {', '.join(threads)}\n"
                f"counters: {', '.join(counters)}", title="export")
    lesson.check(rc == 0 and tracks == {rid for a in ARRIVALS.values() for rid, _, _ in a},
                 "the export has one async track per request: A, B, C and D")
    lesson.check(sum(1 for e in evs if e["ph"] == "X" and e["tid"] == 1 and e["name"].startswith("step ")) == len(live),
                 f"and one slice per engine step ({len(live)}) on the 'engine steps' thread")
    lesson.check(
        "vllm:kv_cache_usage_perc" in counters, "KV-cache usage is a counter track, under vLLM V1's metric name"
    )
    lesson.say(
        "**To look at it:** open https://ui.perfetto.dev, click *Open trace file* and pick the `.json` file "
        "(or drag it onto the page); `chrome://tracing` opens it too. Each request is a row with its "
        "*queued → prefill → decode* phases (and back to *queued* if it is preempted); the **engine steps** "
        "row has one slice per step with *schedule / execute / postprocess* inside and the batch in its "
        "arguments; the **kernels** row shows every launch; counters draw the queue lengths and KV-cache "
        "usage. `W`/`S` zoom, `A`/`D` pan; click a slice to see its arguments."
        + (f"\n\nThis run's files stay in `{tmp}`." if lesson.pause_enabled else ""))


if __name__ == "__main__":
    sys.exit(main(globals()))
