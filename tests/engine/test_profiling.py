"""Profiling on demand (LLM.start_profile / stop_profile, EngineCore.profile): while on, every op
of the forward pass and of the sampler is a kernel launch with its layer, shapes, op kind, FLOPs
and bytes, for GPT-2, Llama and Qwen3, on one rank, on two (each rank its own ops) and with the
engine core in its own process; outputs are the same as without it; off, the only launches are
the attention kernels'; the profiler events mark the window; --profiler-dir writes a
torch.profiler trace."""
from __future__ import annotations

import json
from collections import Counter

import pytest

from engine import LLM, Hooks, SamplingParams
from engine.arg_utils import engine_config
from engine.builtin_model import builtin_path
from engine.trace_names import KERNEL, PROFILE_START, PROFILE_STOP, PROFILER
from tests.engine.hf_reference import hf_greedy
from tests.engine.test_llama_family import llama, qwen3  # noqa: F401 (fixtures)

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = [list(range(10, 30)), list(range(40, 47))]
# the input kernels' references (kernels/input_batch.py): four build the step's inputs before the first layer,
# post_update writes its sampled tokens back after sampling
INPUTS = {"prepare_prefill_inputs_ref", "prepare_pos_seq_lens_ref", "gather_block_tables_ref",
          "compute_slot_mappings_ref", "post_update_ref"}
# on a CPU (attention_backend=cpu) decodes and short queries attend in the C kernel, a prefill of more than
# 8 tokens (PROMPTS[0]'s first) in the PyTorch reference
GPT2_DECODE = INPUTS | {"wte", "wpe", "plan_attention", "ln_1", "c_attn", "reshape_and_cache_ref",
                        "cpu_attention_with_kv_cache", "attn.c_proj", "ln_2", "c_fc", "gelu_new", "mlp.c_proj",
                        "ln_f", "lm_head", "argmax"}
PER_LAYER = {"ln_1", "c_attn", "reshape_and_cache_ref", "unified_attention_ref", "cpu_attention_with_kv_cache",
             "attn.c_proj", "ln_2", "c_fc", "gelu_new", "mlp.c_proj"}
OPS = {"wte": "embedding", "wpe": "embedding", "ln_1": "norm", "c_attn": "matmul", "attn.c_proj": "matmul",
       "c_fc": "matmul", "gelu_new": "elementwise", "lm_head": "matmul", "argmax": "sampler",
       "reshape_and_cache_ref": "cache_write", "unified_attention_ref": "attention",
       "cpu_attention_with_kv_cache": "attention", "all_reduce": "collective",
       "all_gather": "collective"}


class Recorder:
    def __init__(self):
        self.hooks, self.events = Hooks(), []
        self.hooks.subscribe(lambda *e: self.events.append(e),
                             lambda events, at_ns=None: self.events.extend(events))

    def launches(self, step: int | None = None) -> list[tuple]:
        return [e for e in self.events if e[0] == KERNEL and (step is None or e[4] == step)]

    def steps(self) -> list[int]:
        return sorted({e[4] for e in self.launches() if e[4] is not None})


def _tokens(llm, prompts, params=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                          use_tqdm=False)]


def test_gpt2_every_op_while_profiling_and_only_the_kernels_otherwise():
    rec = Recorder()
    llm = LLM("tiny-gpt2", hooks=rec.hooks)
    before = _tokens(llm, PROMPTS)
    unprofiled = {e[1] for e in rec.launches()}
    assert unprofiled == INPUTS | {"reshape_and_cache_ref", "unified_attention_ref", "cpu_attention_with_kv_cache"}
    assert not any("flops" in e[5] or e[5].get("profiled") for e in rec.launches())
    rec.events.clear()

    started = llm.start_profile()
    next_step = llm.llm_engine.engine_core.engine_core.scheduler.num_scheduled_steps
    assert started["profiling"] is True and started["step"] == next_step
    assert llm.start_profile()["ranks"] == []  # already on: nothing changes
    during = _tokens(llm, PROMPTS)
    stopped = llm.stop_profile()
    assert during == before == hf_greedy(str(builtin_path()), PROMPTS, GREEDY.max_tokens)

    window = {e[1]: e[4] for e in rec.events if e[0] == PROFILER}
    assert window == {PROFILE_START: started["step"], PROFILE_STOP: stopped["step"]}
    steps = rec.steps()
    # (async scheduling: the last step scheduled may be an empty one, scheduled while the last tokens were in flight)
    assert steps == list(range(started["step"], steps[-1] + 1)) and steps[-1] <= stopped["step"] <= steps[-1] + 1
    for step in steps:
        launches = rec.launches(step)
        assert all(a["profiled"] is True and a["rank"] == 0 for *_, a in launches)
        names = Counter(e[1] for e in launches)
        # (the prompts again: their blocks are cached, the prefills' last 4 and 7 tokens are short queries)
        assert set(names) == GPT2_DECODE, set(names) ^ GPT2_DECODE
        assert all(names[n] == 4 for n in PER_LAYER & GPT2_DECODE) and names["lm_head"] == 1
        for _, name, _, _, _, a in launches:
            assert a["op"] == OPS.get(name, a["op"]) and a["duration_ns"] > 0 and a["timing"] == "wall_clock"
            assert (a["layer_idx"] is None) == (name not in PER_LAYER), name
            if a["op"] in ("matmul", "attention"):
                assert a["flops"] > 0 and a["bytes"] > 0
    decode = rec.launches(steps[-1])  # both requests decode: a batch of 2
    c_attn = next(a for _, n, *_, a in decode if n == "c_attn")
    assert c_attn["args"]["x"] == ((2, 128), "float32") and c_attn["args"]["out"] == ((2, 384), "float32")
    assert c_attn["flops"] == 2 * 2 * 128 * 384 + 2 * 384 and c_attn["meta"]["module"] == "h.0.attn.c_attn"

    rec.events.clear()
    assert _tokens(llm, PROMPTS) == before
    # stopped: the kernels' launches only (the prompts cached: no prefill long enough for the reference)
    assert {e[1] for e in rec.launches()} == unprofiled - {"unified_attention_ref"}
    assert not any("flops" in e[5] for e in rec.launches())
    assert llm.stop_profile()["ranks"] == []


def test_sampler_steps_are_named_as_the_code_names_them():
    rec = Recorder()
    llm = LLM("tiny-gpt2", hooks=rec.hooks)
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=4, logprobs=2, presence_penalty=0.5,
                            min_tokens=2, logit_bias={5: 1.0}, ignore_eos=True)
    before = _tokens(llm, PROMPTS[:1], params)
    llm.start_profile()
    assert _tokens(llm, PROMPTS[:1], params) == before  # the same seeded draws
    sampled = {e[1] for e in rec.launches() if e[5].get("op") == "sampler"}
    _tokens(llm, PROMPTS[:1], SamplingParams(temperature=0, max_tokens=2))  # a greedy row takes the argmax
    llm.stop_profile()
    sampler = {e[1] for e in rec.launches() if e[5].get("op") == "sampler"}
    assert {"log_softmax", "allow_and_ban", "block_stop_tokens", "apply_logit_bias", "apply_penalties",
            "sample"} <= sampled and "argmax" not in sampled  # no greedy row: no argmax over the sampled ones
    assert "argmax" in sampler


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_llama_and_qwen3_ops(arch, request):
    rec = Recorder()
    llm = LLM(request.getfixturevalue(arch), dtype="float32", hooks=rec.hooks)
    try:
        before = _tokens(llm, PROMPTS)
        llm.start_profile()
        assert _tokens(llm, PROMPTS) == before
        llm.stop_profile()
    finally:
        llm.shutdown()
    names = {e[1] for e in rec.launches() if e[5].get("profiled")}
    expected = INPUTS | {"embed_tokens", "input_layernorm", "qkv_proj", "rotary_embedding", "reshape_and_cache_ref",
                "cpu_attention_with_kv_cache", "o_proj", "post_attention_layernorm", "gate_up_proj", "silu_and_mul",
                "down_proj", "norm", "lm_head", "argmax", "plan_attention"}
    assert names == expected | ({"q_norm", "k_norm"} if arch == "qwen3" else set())
    kinds = {e[1]: e[5]["op"] for e in rec.launches() if e[5].get("profiled")}
    assert kinds["qkv_proj"] == kinds["lm_head"] == "matmul" and kinds["input_layernorm"] == "norm"
    assert kinds["rotary_embedding"] == kinds["silu_and_mul"] == "elementwise"


@pytest.mark.slow
def test_two_ranks_each_profile_their_own_ops(tmp_path):
    rec = Recorder()
    llm = LLM("tiny-gpt2", hooks=rec.hooks, tensor_parallel_size=2, profiler_dir=str(tmp_path))
    try:
        started = llm.start_profile()
        assert [r["rank"] for r in started["ranks"]] == [0, 1]
        got = _tokens(llm, PROMPTS)
        stopped = llm.stop_profile()
    finally:
        llm.shutdown()
    files = [r["trace_file"] for r in stopped["ranks"]]  # torch.profiler: one file per rank
    assert [f.rsplit("/", 1)[1].split(".")[0] for f in files] == ["rank0", "rank1"]
    assert all(json.loads(open(f).read())["traceEvents"] for f in files)
    assert got == _tokens(LLM("tiny-gpt2"), PROMPTS)
    step = rec.steps()[-1]
    for rank in (0, 1):
        launches = [(n, a) for _, n, _, _, _, a in rec.launches(step) if a["rank"] == rank]
        names = Counter(n for n, _ in launches)
        assert set(names) == GPT2_DECODE | {"all_reduce", "all_gather"}
        assert names["all_reduce"] == 2 * 4 + 1 and names["all_gather"] == 1  # per layer 2, the embedding's
        c_attn = next(a for n, a in launches if n == "c_attn")
        assert c_attn["args"]["out"] == [[2, 192], "float32"]  # this rank's half of the heads (msgpack: lists)
        assert all(a["profiled"] and a["op"] == OPS.get(n, a["op"]) for n, a in launches)
        reduce = next(a for n, a in launches if n == "all_reduce")
        assert reduce["bytes"] > 0 and reduce["flops"] > 0


@pytest.mark.slow
def test_the_engine_core_in_its_own_process(tmp_path):
    rec = Recorder()
    llm = LLM("tiny-gpt2", hooks=rec.hooks, multiprocess=True, profiler_dir=str(tmp_path))
    try:
        before = _tokens(llm, PROMPTS[:1])
        started = llm.start_profile()
        assert _tokens(llm, PROMPTS[:1]) == before
        stopped = llm.stop_profile()
    finally:
        llm.shutdown()
    assert {e[1] for e in rec.launches() if e[5].get("profiled")} == GPT2_DECODE
    window = {e[1]: e[5] for e in rec.events if e[0] == PROFILER}
    assert window[PROFILE_START]["profiler_dir"] == str(tmp_path)
    (trace_file,) = window[PROFILE_STOP]["trace_files"]
    assert stopped["ranks"][0]["trace_file"] == trace_file and trace_file.startswith(str(tmp_path))
    assert started["step"] <= stopped["step"]
    chrome = json.loads(open(trace_file).read())  # torch.profiler's: every aten op, the steps annotated
    names = {e.get("name") for e in chrome["traceEvents"]}
    assert "aten::addmm" in names and f"step {rec.steps()[-1]}" in names  # the last step that ran a batch


def test_profiler_dir_defaults_to_vllm_torch_profiler_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("VLLM_TORCH_PROFILER_DIR", str(tmp_path))
    assert engine_config("tiny-gpt2").profiler_dir == str(tmp_path)
    assert engine_config("tiny-gpt2", profiler_dir="elsewhere").profiler_dir == "elsewhere"
    monkeypatch.delenv("VLLM_TORCH_PROFILER_DIR")
    assert engine_config("tiny-gpt2").profiler_dir is None


def test_a_profiler_dir_that_cannot_be_written_is_refused_at_start(tmp_path):
    from engine.config import ConfigError

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match="profiler_dir .* cannot hold torch.profiler traces"):
        engine_config("tiny-gpt2-random", profiler_dir=str(blocker / "traces"))  # under a file: never a directory
    made = tmp_path / "new" / "traces"
    assert engine_config("tiny-gpt2-random", profiler_dir=str(made)).profiler_dir == str(made) and made.is_dir()
