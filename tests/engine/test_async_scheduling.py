"""Async scheduling (AsyncScheduler, EngineCore.step_with_batch_queue): the same tokens as the
synchronous step in every mode (greedy: transformers'; seeded sampling: the sync engine's), with
step N+1 really scheduled while step N's forward pass runs."""
import pytest

from engine import LLM, SamplingParams
from engine.builtin_model import DRAFT_NAME, NAME, builtin_path
from engine.core.sched.async_scheduler import AsyncScheduler
from engine.hooks import BEGIN, END, Hooks
from engine.sampling_params import StructuredOutputsParams
from engine.trace_names import EXECUTE_MODEL, MODEL_RUNNER, SCHEDULE, SCHEDULER
from tests.engine.hf_reference import hf_greedy

MAX_NEW = 24
PROMPTS = [[5, 6, 7, 8] * 4, [11, 12, 13] * 5 + [14], [(7 * j + 3) % 250 for j in range(23)], [42] * 3,
           [(5 * j) % 97 for j in range(40)]]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
DRAFT = {"method": "draft_model", "model": DRAFT_NAME, "num_speculative_tokens": 3}
SCHEMA = {"type": "object", "properties": {"color": {"type": "string", "enum": ["red", "green", "blue"]},
                                           "n": {"type": "integer"}}, "required": ["color", "n"]}


def test_the_default_is_vllms_off_on_a_cpu_on_with_cuda_and_the_flag_still_turns_it_on():
    from engine.arg_utils import EngineArgs
    from engine.core.sched.scheduler import Scheduler

    assert EngineArgs(device="cpu").create_engine_config().scheduler.async_scheduling is False
    assert EngineArgs(device="cuda").create_engine_config().scheduler.async_scheduling is True
    assert EngineArgs(device="cpu", async_scheduling=True).create_engine_config().scheduler.async_scheduling is True
    assert EngineArgs().create_engine_config().scheduler.async_scheduling is None  # the engine core decides
    for kw, cls, text in (({}, Scheduler, "async scheduling off (the CPU default, as vLLM)"),
                          ({"async_scheduling": True}, AsyncScheduler,
                           "async scheduling on (asked for; vLLM keeps it off on a CPU)")):
        llm = LLM(NAME, device="cpu" if kw else None, num_kv_blocks=16, **kw)
        core = _core(llm)
        try:
            assert type(core.scheduler) is cls and core.config.scheduler.async_scheduling == bool(kw)
            assert dict((n, d) for n, _, d in core.startup)["model_load"]["scheduling"] == text
        finally:
            llm.shutdown()


def test_the_api_servers_config_needs_no_torch():  # the device (and with it the default) is the core's to find
    import subprocess
    import sys
    code = ("import sys; from engine.arg_utils import EngineArgs; c = EngineArgs().create_engine_config(); "
            "assert c.scheduler.async_scheduling is None; assert 'torch' not in sys.modules, 'torch imported'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-1000:]


def _core(llm: LLM):
    return llm.llm_engine.engine_core.engine_core


def _generate(prompts, params, **kw):
    kw.setdefault("async_scheduling", True)  # the subject here (the engine's default on a CPU is synchronous)
    llm = LLM(NAME, **kw)
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
        if not kw.get("multiprocess") and kw.get("tensor_parallel_size", 1) == 1:
            stats = _core(llm).stats()
            assert stats.num_free_blocks == stats.num_total_blocks, "blocks leaked"
            assert isinstance(_core(llm).scheduler, AsyncScheduler) == kw["async_scheduling"]
        return [[c.token_ids for c in o.outputs] for o in outs]
    finally:
        llm.shutdown()


GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)


@pytest.mark.slow
@pytest.mark.parametrize("spec, settings", [(NGRAM, {}), (NGRAM, dict(num_kv_blocks=20, block_size=4)),
                                            (DRAFT, {}), (DRAFT, dict(num_kv_blocks=20, block_size=4)),
                                            (DRAFT, dict(max_num_batched_tokens=16, block_size=4))],
                         ids=["ngram", "ngram-preemption", "draft", "draft-preemption", "draft-chunked"])
def test_speculation_greedy_equals_transformers(spec, settings):
    """Placeholder draft ids in the scheduler, the worker's own drafts verified."""
    got = _generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, speculative_config=spec,
                    async_scheduling=True, **settings)
    assert [o[0] for o in got] == hf_greedy(str(builtin_path(NAME)), PROMPTS, MAX_NEW)


def _spec_counters(llm: LLM) -> tuple[list, dict]:
    """The engine's spec-decode statistics, and the same as /metrics counts them (vLLM's counter names)."""
    from dataclasses import replace
    from types import SimpleNamespace

    from engine.entrypoints.openai.metrics import ServerMetrics

    stats = _core(llm).stats()
    engine = SimpleNamespace(stats=replace(stats, spec_num_drafts=0, spec_num_draft_tokens=0,
                                           spec_num_accepted_tokens=0, spec_num_accepted_tokens_per_pos=[]),
                             step_listeners=[])
    metrics = ServerMetrics(engine, NAME)
    metrics.on_step([], stats, [])
    scraped = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in metrics.render().decode().splitlines()
               if line.startswith("vllm:spec_decode")}
    return [stats.spec_num_drafts, stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens,
            stats.spec_num_accepted_tokens_per_pos], scraped


@pytest.mark.slow
def test_speculation_statistics_count_only_the_drafts_verified():
    """Under async scheduling a step verifies placeholder drafts (-1) that the worker fills with its own
    proposals, often fewer than num_speculative_tokens (an n-gram proposer finds no match, or a shorter
    one): the ones it had no draft for are not counted as proposed, nor rejected. The counters, in the
    engine's stats and on /metrics, are the synchronous step's; so are the tokens."""
    runs = []
    for on in (True, False):
        llm = LLM(NAME, speculative_config=NGRAM, async_scheduling=on)
        try:
            outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
            runs.append(([o.outputs[0].token_ids for o in outs], *_spec_counters(llm)))
        finally:
            llm.shutdown()
    assert runs[0] == runs[1]
    tokens, (drafts, draft_tokens, accepted, _), scraped = runs[0]
    assert tokens == hf_greedy(str(builtin_path(NAME)), PROMPTS, MAX_NEW)
    assert 0 < accepted < draft_tokens < NGRAM["num_speculative_tokens"] * drafts  # some proposals were short
    assert scraped[f'vllm:spec_decode_num_draft_tokens_total{{engine="0",model_name="{NAME}"}}'] == draft_tokens


@pytest.mark.slow
def test_seeded_sampling_n_and_priority_are_the_same_on_and_off():
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=s, n=2, max_tokens=16) for s in range(len(PROMPTS))]
    kw = dict(num_kv_blocks=24, block_size=4, scheduling_policy="priority", max_num_seqs=4)
    assert _generate(prompts, params, **kw) == _generate(prompts, params, async_scheduling=False, **kw)


@pytest.mark.slow
def test_structured_outputs_defer_sampling_and_match_sync(monkeypatch):
    deferred = []
    schedule = AsyncScheduler.schedule

    def spy(self):
        out = schedule(self)
        deferred.append(out.pending_structured_output_tokens)
        return out

    monkeypatch.setattr(AsyncScheduler, "schedule", spy)
    prompts = ["JSON: " + "word " * k for k in range(3)] + ["Hello there"]
    so = SamplingParams(temperature=0, max_tokens=30, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    params = [so, so, so, SamplingParams(temperature=0, max_tokens=20)]
    for kw in ({}, dict(num_kv_blocks=20, block_size=4), dict(max_num_batched_tokens=8)):
        assert _generate(prompts, params, **kw) == _generate(prompts, params, async_scheduling=False, **kw)
    assert any(deferred)  # a grammar request's step sampled after the step before it was updated


@pytest.mark.slow
@pytest.mark.parametrize("kw", [dict(tensor_parallel_size=2), dict(multiprocess=True)], ids=["tp2", "core-process"])
def test_tensor_parallel_and_core_process(kw):
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:3]]
    want = hf_greedy(str(builtin_path(NAME)), PROMPTS[:3], MAX_NEW)
    assert [o[0] for o in _generate(prompts, GREEDY, async_scheduling=True, num_kv_blocks=64, **kw)] == want


def test_abort_with_a_step_in_flight():
    llm = LLM(NAME, async_scheduling=True)
    engine, core = llm.llm_engine, _core(llm)
    for i, p in enumerate(PROMPTS[:3]):
        engine.add_request(str(i), {"prompt_token_ids": p}, GREEDY)
    for _ in range(4):
        engine.step()
    assert core.batch_queue  # a step is in flight
    engine.abort_request(["1"])
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert set(done) == {"0", "2"}
    want = hf_greedy(str(builtin_path(NAME)), [PROMPTS[0], PROMPTS[2]], MAX_NEW)
    assert [done["0"], done["2"]] == want
    while core.has_unfinished_requests():  # the last step in flight
        core.step_fn()
    assert core.stats().num_free_blocks == core.stats().num_total_blocks


def test_trace_shows_the_next_step_scheduled_during_the_forward_pass():
    """A recorded async run: some step's schedule begins before the previous step's forward pass
    (on the executor thread) has ended."""
    hooks, events = Hooks(), []
    hooks.subscribe(lambda layer, name, kind, rid, step, attrs: events.append((layer, name, kind, step, attrs)))
    llm = LLM(NAME, hooks=hooks, async_scheduling=True)
    llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    order = [(layer, name, kind, step) for layer, name, kind, step, _ in events]
    overlaps = [s for (layer, name, kind, s) in order if (layer, name, kind) == (SCHEDULER, SCHEDULE, BEGIN)
                and s > 0 and order.index((SCHEDULER, SCHEDULE, BEGIN, s)) <
                order.index((MODEL_RUNNER, EXECUTE_MODEL, END, s - 1))]
    assert len(overlaps) > MAX_NEW // 2
    threads = {a["thread"] for layer, name, _, _, a in events if (layer, name) == (MODEL_RUNNER, EXECUTE_MODEL)}
    assert threads == {"executor"}
