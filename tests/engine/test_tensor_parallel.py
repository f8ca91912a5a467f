"""Tensor parallelism with 2 CPU ranks (gloo): greedy outputs equal TP=1 and transformers under
the default settings, forced preemption, chunked prefill and prefix caching, with no leaked
blocks; every rank's kernels are traced; kernel gates cross into worker rank 0; a dead or
failing worker is a clear error and leaves no process behind.

The tests that ask for the default settings share one TP=2 engine (traced from its start) and one
TP=1 engine, module-scoped: a TP=2 start is two worker processes importing torch and joining gloo,
the largest cost of this file when each test made its own."""
from __future__ import annotations

import os
import signal
import time

import pytest

from engine import LLM, SamplingParams
from engine.builtin_model import NAME, builtin_path
from engine.config import ConfigError
from engine.engine.exceptions import EngineDeadError
from engine.hooks import Hooks
from engine.trace_names import EXECUTE_MODEL, KERNEL, WORKER, is_attention_kernel
from tests.conftest import started_by_this_session
from tests.engine.hf_reference import hf_greedy
from tests.engine.test_hf_equivalence import MAX_NEW, _prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _generate(prompts, llm=None, **kwargs):
    own = llm is None
    llm = LLM(NAME, tensor_parallel_size=2, **kwargs) if own else llm
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        stats = llm.llm_engine.engine_core.engine_core.stats()
        assert stats.num_free_blocks == stats.num_total_blocks, "blocks leaked"
        assert stats.num_waiting == stats.num_running == 0
        return [o.outputs[0].token_ids for o in outs], stats
    finally:
        if own:
            llm.shutdown()


@pytest.fixture(scope="module")
def path():
    return str(builtin_path())


@pytest.fixture(scope="module")
def traced_tp2():
    """One TP=2 engine with the default settings, every event it emitted from its start: (llm, events)."""
    events = []
    hooks = Hooks()
    hooks.subscribe(lambda *e: events.append(e))
    llm = LLM(NAME, tensor_parallel_size=2, hooks=hooks)
    yield llm, events
    llm.shutdown()


@pytest.fixture(scope="module")
def tp1():
    return LLM(NAME)


@pytest.mark.slow
@pytest.mark.parametrize("setting", ["default", "preemption", "chunked_prefill", "prefix_caching"])
def test_tp2_equals_tp1_and_transformers(path, setting, request):
    kwargs = dict(default={}, preemption=dict(num_kv_blocks=12), chunked_prefill=dict(max_num_batched_tokens=16),
                  prefix_caching=dict(enable_prefix_caching=True))[setting]
    prompts = _prompts(shared_prefix=48 if setting == "prefix_caching" else 0)
    shared = setting == "default"
    got, stats = _generate(prompts, request.getfixturevalue("traced_tp2")[0] if shared else None, **kwargs)
    one = request.getfixturevalue("tp1") if shared else LLM(NAME, **kwargs)
    tp1 = one.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert got == [o.outputs[0].token_ids for o in tp1]
    assert got == hf_greedy(path, prompts, MAX_NEW)
    if setting == "preemption":
        assert stats.num_preemptions > 0
    if setting == "prefix_caching":
        assert stats.prefix_cache_hits > 0


@pytest.mark.slow
def test_one_rank_in_a_worker_process_equals_the_model_in_the_core(tp1):
    """--distributed-executor-backend mp with one rank (vLLM's layout: the forward pass in a worker process):
    the same greedy and seeded tokens as the model run in the engine core."""
    prompts = _prompts()
    params = [GREEDY, SamplingParams(temperature=0.9, seed=3, max_tokens=8)]
    llm = LLM(NAME, distributed_executor_backend="mp")
    try:
        assert llm.llm_engine.engine_core.engine_core.model_executor.procs  # a worker process runs the model
        for p in params:
            got = llm.generate([{"prompt_token_ids": q} for q in prompts], p, use_tqdm=False)
            want = tp1.generate([{"prompt_token_ids": q} for q in prompts], p, use_tqdm=False)
            assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    finally:
        llm.shutdown()


def test_seeded_sampling_and_logprobs_equal_tp1(traced_tp2, tp1):
    """Every rank samples with each request's seed, keyed by position: the same draws as TP=1."""
    params = [SamplingParams(temperature=0.9, top_p=0.9, seed=s, max_tokens=12, logprobs=2) for s in range(4)]
    prompts = ["Once upon a time", "The cat", "A list of", "In the morning"]
    tp1 = tp1.generate(prompts, params, use_tqdm=False)
    tp2 = traced_tp2[0].generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in tp2] == [o.outputs[0].token_ids for o in tp1]
    for a, b in zip(tp1, tp2):
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert la.keys() == lb.keys()
            assert all(abs(la[t].logprob - lb[t].logprob) < 1e-4 for t in la)


def test_every_rank_is_traced(traced_tp2):
    llm, all_events = traced_tp2
    start = len(all_events)
    llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    events = all_events[start:]  # this generate's steps (the startup's events are read from all_events below)
    n_layer = 4  # tiny-gpt2
    kernels = [e for e in events if e[0] == KERNEL and e[4] is not None]
    assert {e[5]["rank"] for e in kernels} == {0, 1}
    for step in {e[4] for e in kernels}:
        for rank in (0, 1):
            mine = [e for e in kernels if e[4] == step and e[5]["rank"] == rank]
            reduces = [e for e in mine if e[1] == "all_reduce"]
            # the vocab-parallel embedding's, then attn.c_proj's and mlp.c_proj's in each layer
            assert [e[5]["meta"]["site"] for e in reduces] == ["wte"] + ["attn.c_proj", "mlp.c_proj"] * n_layer
            assert [e[5]["layer_idx"] for e in reduces] == [None] + [i for i in range(n_layer) for _ in "ab"]
            assert all(e[5]["meta"]["bytes"] > 0 and e[5]["duration_ns"] > 0 for e in reduces)
            gathers = [e[5] for e in mine if e[1] == "all_gather"]
            assert [(g["meta"]["site"], g["layer_idx"]) for g in gathers] == [("lm_head", None)]
            assert any(is_attention_kernel(e[1]) for e in mine)
    # every rank ran the sampler on the all-gathered logits and drew the same tokens
    sampled = [e for e in events if e[0] == "sampler" and e[1] == "sampled"]
    for step in {e[4] for e in sampled}:
        mine = {e[5]["rank"]: e[5]["token_ids"] for e in sampled if e[4] == step}
        assert sorted(mine) == [0, 1] and mine[0] == mine[1]
    pids = {e[5]["pid"] for e in kernels}
    assert len(pids) == 2 and os.getpid() not in pids  # each rank's own process
    # both workers received the same scheduler output, every step
    received = [e for e in events if e[0] == WORKER and e[1] == EXECUTE_MODEL]
    for step in {e[4] for e in received}:
        mine = [e[5] for e in received if e[4] == step]
        assert sorted(a["rank"] for a in mine) == [0, 1]
        assert len({a["digest"] for a in mine}) == 1 and len({str(a["num_scheduled_tokens"]) for a in mine}) == 1
    # each rank's startup: its heads, and its share of the KV cache
    loads = {e[5]["rank"]: e[5] for e in all_events if e[0] == WORKER and e[1] == "model_load" and e[2] == "end"}
    assert loads[0]["heads"] == [0, 2] and loads[1]["heads"] == [2, 4]
    assert loads[0]["vocab"] == [0, 2048] and loads[1]["vocab"] == [2048, 4096]  # wte: 4096 rows, split
    kv = [e[5] for e in all_events if e[0] == "engine" and e[1] == "kv_cache_alloc" and e[2] == "end"][0]
    assert [r["heads"] for r in kv["ranks"]] == [[0, 2], [2, 4]]


@pytest.mark.slow
def test_kernel_gates_reach_worker_rank_0_and_outlast_the_timeout():
    """A controller holds rank 0 inside the forward pass, longer than the collective timeout: the
    gated step runs on the long-timeout group, so rank 1 waits in its all-reduce instead of failing.
    While held before an attention launch, the rerun on Triton happens in rank 0's process."""
    hooks, seen, reruns = Hooks(), [], []

    def gate(point, info):
        if point != KERNEL:
            return
        seen.append(info["name"])
        if len(seen) == 1:
            time.sleep(1.5)  # > distributed_timeout_s
        if is_attention_kernel(info["name"]) and not reruns:
            reruns.append(llm.llm_engine.engine_core.engine_core.held_attention_on_triton())

    llm = LLM(NAME, tensor_parallel_size=2, distributed_timeout_s=1.0, hooks=hooks)
    try:
        hooks.add_gate(gate)
        out = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    finally:
        llm.shutdown()
    assert len(out[0].outputs[0].token_ids) == 2
    assert "all_reduce" in seen and "all_gather" in seen and any(map(is_attention_kernel, seen))
    assert reruns and reruns[0]["max_abs_diff"] < 1e-3


def test_vocab_parallel_embedding_pads_to_64_and_its_shards_sum_to_the_table():
    """GPT-2's 50,257 rows pad to 50,304 (a multiple of 64) and split evenly; each rank's lookup
    zeroes the ids it does not hold, so the ranks' results add up to the full embedding."""
    import torch

    from engine.distributed.parallel_state import TPGroup
    from engine.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding, pad_vocab_size

    assert [pad_vocab_size(50257, n) for n in (1, 2, 3, 4)] == [50257, 50304, 50304, 50304]
    assert pad_vocab_size(4096, 2) == 4096 and pad_vocab_size(4096, 3) == 4224  # and splits evenly
    full, ids = torch.randn(100, 8), torch.tensor([0, 5, 63, 64, 99, 70])
    parts = []
    for rank in (0, 1):
        tp = TPGroup(rank, 2)
        tp.all_reduce = lambda x, site: x  # the sum is taken below, over the two ranks' results
        emb = VocabParallelEmbedding(100, 8, tp)
        assert emb.shard_range == (rank * 64, (rank + 1) * 64)  # 100 rows pad to 128
        emb.weight.data.copy_(emb.shard(full))
        parts.append(emb(ids))
    assert torch.equal(parts[0] + parts[1], full[ids])


def test_bad_sizes_are_clear_errors():
    with pytest.raises(ValueError, match="must divide the model's 4 attention heads.*choose one of \\[1, 2, 4\\]"):
        LLM(NAME, tensor_parallel_size=3)
    with pytest.raises(ConfigError, match="tensor_parallel_size must be an integer >= 1"):
        LLM(NAME, tensor_parallel_size=0)


@pytest.mark.slow
def test_a_worker_that_fails_to_start_is_one_clear_error():
    before = _worker_pids()
    with pytest.raises(EngineDeadError, match="worker rank [01]: RuntimeError: No rendezvous handler for bogus://"):
        LLM(NAME, tensor_parallel_size=2, distributed_init_method="bogus://nowhere")
    deadline = time.monotonic() + 10  # a rank still importing torch (a loaded machine) stops when it reads "stop"
    while not _worker_pids() <= before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _worker_pids() <= before, "orphaned worker processes"


@pytest.mark.slow
def test_a_dead_worker_fails_the_engine_without_orphans():
    llm = LLM(NAME, tensor_parallel_size=2)
    pids = [p.pid for p in llm.llm_engine.engine_core.engine_core.model_executor.procs]
    assert set(pids) <= _worker_pids()  # the leftover check below sees this session's workers
    os.kill(pids[1], signal.SIGKILL)
    with pytest.raises(EngineDeadError, match=r"worker rank 1 died \(signal 9\)"):
        llm.generate(["Once upon a time"], SamplingParams(max_tokens=4), use_tqdm=False)
    deadline = time.monotonic() + 10
    while any(map(_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(map(_alive, pids)), "worker rank 0 outlived the dead rank"
    assert not os.path.exists(llm.llm_engine.engine_core.engine_core.model_executor._dir), \
        "the workers' socket directory was left behind"
    with pytest.raises(EngineDeadError):  # and it stays dead, with the same reason
        llm.generate(["again"], SamplingParams(max_tokens=1), use_tqdm=False)
    llm.shutdown()


def test_a_send_to_a_dead_rank_raises_instead_of_blocking(tmp_path):
    """A PUSH socket whose peer is gone blocks a plain send for ever; the executor holds its send
    lock meanwhile, so the rank's death could never be marked. Its send says the rank died."""
    import subprocess
    import sys
    import threading

    import zmq

    from engine.executor.multiproc_executor import MultiprocExecutor, WorkerDiedError

    ex = MultiprocExecutor.__new__(MultiprocExecutor)  # just the plumbing: one rank, already dead
    ex.tensor_parallel_size, ex.dead, ex.on_dead, ex._closing, ex._reruns = 1, None, None, False, {}
    ex._send_lock, ex._dir, ex.ctx = threading.Lock(), str(tmp_path), zmq.Context()
    ex.results = ex.ctx.socket(zmq.PULL)
    sock = ex.ctx.socket(zmq.PUSH)
    sock.bind(f"ipc://{tmp_path}/rank0")  # nobody connects: a send finds no room
    ex.inputs = [sock]
    proc = subprocess.Popen([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"])
    proc.wait()
    ex.procs, ex._reader = [proc], threading.Thread(target=lambda: None)
    ex._reader.start()
    raised = []

    def send():
        try:
            ex._broadcast(b"step", b"")
        except WorkerDiedError as e:
            raised.append(e)

    t = threading.Thread(target=send, daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "the send blocked"
    assert [str(e) for e in raised] == ["worker rank 0 died (signal 9)"]
    assert ex.dead == "worker rank 0 died (signal 9)"


def _worker_pids() -> set[int]:
    pids = set()
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    if b"engine.executor.worker_proc" in f.read() and started_by_this_session(d):
                        pids.add(int(d))
            except OSError:
                pass
    return pids


def test_llm_engine_objects_say_where_they_live(traced_tp2):
    with pytest.raises(AttributeError, match="live in the worker processes"):
        traced_tp2[0].llm_engine.engine_core.engine_core.model_runner


@pytest.mark.slow
def test_triton_backend_with_two_ranks():
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = ["Once upon a time", "The cat sat on the mat and then"]
    one = LLM(NAME, attention_backend="triton", num_kv_blocks=32).generate(prompts, params, use_tqdm=False)
    llm = LLM(NAME, attention_backend="triton", num_kv_blocks=32, tensor_parallel_size=2)
    try:
        two = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in two] == [o.outputs[0].token_ids for o in one]


def test_the_parameter_count_is_the_models_whatever_the_ranks(traced_tp2, tp1):
    """Norms, position embeddings and row-parallel biases are on every rank: counted once."""
    def model_load(llm):
        core = llm.llm_engine.engine_core.engine_core
        return next(details for stage, _, details in core.startup if stage == "model_load")

    one, llm = tp1, traced_tp2[0]
    full, split = model_load(one), model_load(llm)
    ranks = llm.llm_engine.engine_core.engine_core.model_executor.ranks
    model = one.llm_engine.engine_core.engine_core.model
    assert split["params"] == full["params"] == sum(p.numel() for p in model.parameters())
    assert sum(r["params"] for r in ranks) > full["params"] > 0  # each rank's shard: what is whole, on both
