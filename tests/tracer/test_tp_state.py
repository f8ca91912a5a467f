"""The fold with tensor parallelism: every rank's launches kept with their rank, the workers'
startup and steps, the KV shards; an old trace (no rank, no parallel config) is one rank.
Synthetic events as the contract says, then a real TP=2 run checked against the engine's own
numbers."""
from __future__ import annotations

import pytest

from tests.tui.tp_events import N_HEAD, N_LAYER, NUM_BLOCKS, tp_events
from tracer.state import TraceState, fold, kv_shards, rank_of, step_ranks


def folded(events) -> TraceState:
    s = TraceState()
    for ev in events:
        fold(s, ev)
    return s


def test_every_ranks_launches_are_kept_with_their_rank():
    s = folded(tp_events(n=2))
    assert s.tensor_parallel_size == 2 and step_ranks(s) == [0, 1]
    per_rank = {r: [k for k in s.kernels if rank_of(k) == r] for r in (0, 1)}
    for r, launches in per_rank.items():
        names = [k["name"] for k in launches]
        assert names.count("all_reduce") == 2 * N_LAYER and names.count("all_gather") == 1
        sites = [k["meta"]["site"] for k in launches if k["name"] == "all_reduce"]
        assert sites == ["attn.c_proj", "mlp.c_proj"] * N_LAYER
    # the per-step sparklines follow rank 0 only: rank 1's launches take twice as long
    ns = sum(k["duration_ns"] for k in per_rank[0] if k["name"] == "all_reduce")
    assert s.kernel_history["all_reduce"] == [ns]


def test_the_workers_startup_and_the_step_they_received():
    s = folded(tp_events(n=2, steps=2))
    assert [w["rank"] for w in s.workers] == [0, 1]
    for r, w in enumerate(s.workers):
        assert w["model_load"]["heads"] == [r * N_HEAD // 2, (r + 1) * N_HEAD // 2]
        assert w["kv_cache_alloc"]["num_blocks"] == NUM_BLOCKS and w["ready"] and w["current"] is None
        assert w["execute_model"]["step"] == 1 and w["execute_model"]["digest"] == "d0001"
    assert [sh["heads"] for sh in kv_shards(s)] == [[0, 2], [2, 4]]
    assert s.num_blocks == NUM_BLOCKS
    # the engine's own stages stay one line each: the workers' are theirs, not the engine's
    assert [st["stage"] for st in s.startup] == ["model_load", "kv_cache_alloc"]


def test_a_worker_stage_in_progress_is_seen():
    events = tp_events(n=2)
    cut = next(i for i, ev in enumerate(events) if ev.layer == "worker" and ev.kind == "end")
    s = folded(events[:cut])
    assert s.workers[0]["current"] == "model_load" and "model_load" not in s.workers[0]


def test_an_old_trace_is_one_rank():
    s = folded(tp_events(n=1, with_rank=False))
    assert s.tensor_parallel_size == 1 and step_ranks(s) == [0] and s.workers == [] and kv_shards(s) == []
    assert all("rank" not in k and rank_of(k) == 0 for k in s.kernels)


def test_workers_survive_json_and_clones():
    s = folded(tp_events(n=2))
    back = TraceState.from_dict(s.to_dict())
    assert back.workers == s.workers and back.tensor_parallel_size == 2
    import orjson
    assert TraceState.from_dict(orjson.loads(s.to_json())["state"]).workers == s.workers
    c = s.clone()
    fold(s, tp_events(n=2, steps=2)[-3])  # a later execute_model / launch changes s only
    fold(s, tp_events(n=2, steps=2)[-20])
    assert c.workers[0]["execute_model"]["step"] == 0


@pytest.mark.slow
def test_a_real_two_rank_run_folds_to_the_engines_shards():
    from engine import LLM, Hooks, SamplingParams
    from engine.model_executor.model_loader import read_config, resolve
    from tracer.session import TraceSession

    hooks = Hooks()
    session = TraceSession(hooks, control=False)
    # synchronous: the checks read the last step's launches (async scheduling ends on an empty step)
    llm = LLM("tiny-gpt2", hooks=hooks, block_size=4, tensor_parallel_size=2, async_scheduling=False)
    try:
        llm.generate(["Hello there", "x"], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
        s = session.state.view()
    finally:
        session.close()
        llm.shutdown()  # the workers
    cfg = read_config(resolve("tiny-gpt2"))
    assert s.tensor_parallel_size == 2 and [w["rank"] for w in s.workers] == [0, 1]
    heads = [w["model_load"]["heads"] for w in s.workers]
    assert heads[0][0] == 0 and heads[0][1] == heads[1][0] and heads[1][1] == cfg.n_head
    assert [sh["heads"] for sh in kv_shards(s)] == heads
    assert step_ranks(s) == [0, 1]
    for r in (0, 1):
        mine = [k for k in s.kernels if rank_of(k) == r]
        assert sum(k["name"] == "all_reduce" for k in mine) == 2 * cfg.n_layer + 1  # and the embedding's
        assert all(k["meta"]["bytes"] > 0 for k in mine if k["name"] == "all_reduce")
    digests = {w["execute_model"]["digest"] for w in s.workers}
    assert len(digests) == 1 and {w["execute_model"]["step"] for w in s.workers} == {s.step}
