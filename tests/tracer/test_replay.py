"""Replay and the fold, checked against the engine's own snapshots and outputs."""
import json
import random

import pytest
from tracer_helpers import traced_run

from tracer.events import read_trace
from tracer.replay import Replay
from tracer.state import TraceState, fold, snapshot_view


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run that preempts (few blocks), hits the prefix cache and chunks a prefill."""
    path = tmp_path_factory.mktemp("replay") / "trace.jsonl"
    # synchronous: "at step k" is read against step k's own snapshot (async, step k + 1 is scheduled by then)
    outs, session = traced_run(path, num_kv_blocks=14, max_num_batched_tokens=24, async_scheduling=False)
    return path, outs, session


def test_the_run_exercises_preemption_prefix_hits_and_chunking(run):
    _, events = read_trace(run[0])
    names = {(e.layer, e.name) for e in events}
    assert ("scheduler", "PREEMPTED") in names and ("block_manager", "cache_hit") in names
    snaps = [e.attrs for e in events if e.kind == "snapshot"]
    assert any(s["waiting_reasons"] for s in snaps)
    assert any(s["kind"] == "prefill" and s["num_computed_before"] > 0 for snap in snaps for s in snap["scheduled"])


def test_replay_at_step_k_reproduces_the_snapshot_of_step_k(run):
    _, events = read_trace(run[0])
    replay = Replay.load(run[0])
    recorded = {e.step: e.attrs for e in events if e.kind == "snapshot"}
    assert sorted(recorded) == replay.steps
    for k in replay.steps:
        state = replay.goto(k)
        assert state.step == k and state.snapshot == recorded[k]
        assert state.batch is not None and state.sampled is not None


def test_fold_tracks_the_queues_between_snapshots(run):
    """Just before each snapshot, the fold has applied only arrivals, admissions, preemptions,
    finishes and block events since the last one: its queues must already equal the engine's."""
    _, events = read_trace(run[0])
    state = TraceState()
    checked = 0
    for ev in events:
        if ev.kind == "snapshot":
            mine = snapshot_view(state)
            for q in ("waiting", "running"):
                theirs = [(r["request_id"], r["status"], r["block_table"], r["num_tokens"], r["num_output_tokens"])
                          for r in ev.attrs[q]]
                assert [(r["request_id"], r["status"], r["block_table"], r["num_tokens"], r["num_output_tokens"])
                        for r in mine[q]] == theirs, (ev.step, q)
            checked += 1
        fold(state, ev)
        if ev.layer == "engine" and ev.name == "step" and ev.kind == "end":
            stats = ev.attrs["stats"]
            assert (len(state.waiting), len(state.running)) == (stats["num_waiting"], stats["num_running"])
            held = {b for r in state.requests.values() for b in r.block_table}
            assert len(held) == stats["num_total_blocks"] - stats["num_free_blocks"]
    assert checked > 5


def test_backward_then_forward_returns_the_same_state(run):
    replay = Replay.load(run[0], checkpoint_every=4)
    forward = {k: replay.goto(k).to_dict() for k in replay.steps}
    for k in reversed(replay.steps):
        assert replay.goto(k).to_dict() == forward[k]
    rng = random.Random(0)
    for k in rng.choices(replay.steps, k=30):
        assert replay.goto(k).to_dict() == forward[k]
    replay.goto(replay.steps[3])
    assert replay.prev().to_dict() == forward[replay.steps[2]]
    assert replay.next().to_dict() == forward[replay.steps[3]]
    assert replay.next().to_dict() == forward[replay.steps[4]]


def test_replayed_text_and_final_state_match_the_engine(run):
    path, outs, session = run
    final = Replay.load(path).final()
    for out in outs:
        req = final.requests[out.request_id]
        assert req.text == out.outputs[0].text and req.output_token_ids == out.outputs[0].token_ids
        assert req.finish_reason == out.outputs[0].finish_reason
        assert req.prompt_token_ids == out.prompt_token_ids and "".join(req.prompt_pieces) == out.prompt
    assert final.waiting == final.running == [] and sorted(final.finished) == sorted(o.request_id for o in outs)
    assert [s["stage"] for s in final.startup] == ["resolve_model", "tokenizer_load", "model_load", "kv_cache_alloc"]
    assert final.num_blocks == 14 and final.engine_config["cache"]["num_kv_blocks"] == 14
    # the live fold of the same run (from the bus) ends in the same state (both keep the latest
    # MAX_FINISHED finished requests: here, all of them)
    assert session.state.state.to_dict() == final.to_dict()


def test_text_grows_step_by_step(run):
    replay = Replay.load(run[0])
    previous = {}
    for k in replay.steps:
        state = replay.goto(k)
        for rid, req in state.requests.items():
            assert req.text.startswith(previous.get(rid, ""))
        previous = {rid: r.text for rid, r in state.requests.items()}


def test_unknown_step_is_an_error(run):
    with pytest.raises(KeyError, match="not in this trace"):
        Replay.load(run[0]).goto(10_000)


def test_a_version_1_recording_replays_as_version_2(run, tmp_path):
    """Version 1 put the step's total under num_scheduled_tokens; replay reads it in the current form."""
    path = tmp_path / "v1.jsonl"
    old = []
    for i, line in enumerate(run[0].read_text().splitlines()):
        d = json.loads(line)
        if i == 0:
            d["version"] = 1
        elif d["layer"] == "scheduler" and d["name"] == "schedule" and "total_num_scheduled_tokens" in d["attrs"]:
            d["attrs"].pop("num_scheduled_tokens", None)
            d["attrs"]["num_scheduled_tokens"] = d["attrs"].pop("total_num_scheduled_tokens")
        old.append(json.dumps(d))
    path.write_text("\n".join(old) + "\n")
    assert not any('"total_num_scheduled_tokens"' in line for line in old)
    _, events = read_trace(run[0])
    recorded = {e.step: e.attrs for e in events if e.kind == "snapshot"}
    replay = Replay.load(path)
    assert sorted(recorded) == replay.steps
    for k in replay.steps:
        snap = replay.goto(k).snapshot
        assert snap == recorded[k]
        assert snap["total_num_scheduled_tokens"] == sum(snap["num_scheduled_tokens"].values())
    assert any(s["total_num_scheduled_tokens"] > 0 for s in recorded.values())
    ends = [e for e in read_trace(path)[1] if e.name == "schedule" and e.kind == "end"]
    assert ends and all(isinstance(e.attrs["total_num_scheduled_tokens"], int) for e in ends)


def test_an_unknown_version_is_one_clear_error(run, tmp_path):
    lines = run[0].read_text().splitlines()
    header = json.loads(lines[0]) | {"version": 99}
    path = tmp_path / "v99.jsonl"
    path.write_text("\n".join([json.dumps(header), *lines[1:]]) + "\n")
    with pytest.raises(ValueError, match="schema version 99, this tracer reads 1, 2"):
        read_trace(path)
