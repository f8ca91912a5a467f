"""Mixtures of experts (Qwen3-MoE, Mixtral) give transformers' greedy outputs, near-ties
excepted: random tiny checkpoints built by transformers and saved both ways the experts are
stored (one tensor per expert and projection, as save_pretrained and the hub write them; all
experts fused in 3-D gate_up_proj / down_proj, as transformers 5 holds them), on the torch
and Triton backends, under preemption, chunked prefill and prefix caching, over two
tensor-parallel ranks, with expert parallelism (disjoint experts per rank) and with the core in
its own process. The Qwen3-MoE one renormalises its top-k weights and has a dense layer
(mlp_only_layers); the Mixtral one 4 experts, top-2. Also: the routing events, the profile's
cost of the experts used, the Triton launches' expert blocks, `t` on a held fused-MoE launch.

The settings that start an engine per case (preemption, chunked prefill, prefix caching, TP=2,
expert parallelism) run on the Qwen3-MoE checkpoint only: its router path is the richer one
(renormalised top-k over 8 experts, a dense layer between sparse ones), and each case is a
tensor-parallel start or a transformers reference of its own, the costs this suite keeps down.
Both checkpoints run every path through the layer: both weight layouts, both backends, and the
core in its own process."""
from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from engine import LLM, Hooks, SamplingParams
from engine.arg_utils import engine_config
from engine.builtin_model import write_byte_tokenizer
from engine.model_executor.layers.fused_moe import FusedMoE
from engine.trace_names import BATCH, KERNEL, MODEL_RUNNER, ROUTING
from tests.engine.hf_reference import assert_greedy_equal
from tests.engine.test_hf_equivalence import _prompts
from tests.engine.test_llama_family import _generate as generate

MAX_NEW = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
COMMON = dict(vocab_size=257, hidden_size=64, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
              max_position_embeddings=256, bos_token_id=256, eos_token_id=256, initializer_range=0.25)


def _hf_model(arch: str):
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(2)
    if arch == "qwen3_moe":
        cfg = Qwen3MoeConfig(**COMMON, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                             num_experts_per_tok=2, head_dim=16, norm_topk_prob=True, mlp_only_layers=[1])
        return Qwen3MoeForCausalLM(cfg)
    return MixtralForCausalLM(MixtralConfig(**COMMON, intermediate_size=32, num_local_experts=4,
                                            num_experts_per_tok=2))


def _save(path: Path, model, fused: bool) -> str:
    if fused:  # the experts as transformers 5 holds them: experts.gate_up_proj [E, 2I, H], experts.down_proj
        from safetensors.torch import save_file

        model.config.save_pretrained(path)
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path / "model.safetensors"),
                  metadata={"format": "pt"})
    else:
        model.save_pretrained(path)
    write_byte_tokenizer(path, 256)
    return str(path)


_SAVED: dict[str, str] = {}


def _checkpoint(arch: str, tmp_path_factory) -> str:
    """The per-expert checkpoint (what save_pretrained writes), once per architecture."""
    if arch not in _SAVED:
        _SAVED[arch] = _save(tmp_path_factory.mktemp(arch), _hf_model(arch), fused=False)
    return _SAVED[arch]


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def moe(request, tmp_path_factory):
    return _checkpoint(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    return _checkpoint("qwen3_moe", tmp_path_factory)


def _generate(path, prompts, **kwargs):
    return generate(path, prompts, GREEDY, **kwargs)  # MAX_NEW tokens each


def test_saved_checkpoint_has_one_tensor_per_expert(moe):
    from safetensors import safe_open

    with safe_open(f"{moe}/model.safetensors", "pt") as f:
        keys = set(f.keys())
    proj = "mlp.experts.7.gate_proj" if "qwen3_moe" in moe else "block_sparse_moe.experts.3.w1"
    assert f"model.layers.0.{proj}.weight" in keys and not any("gate_up_proj" in k for k in keys)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_fused_expert_layout_equals_transformers(arch, tmp_path):
    model = _hf_model(arch)
    assert any(k.endswith("experts.gate_up_proj") for k in model.state_dict())
    path = _save(tmp_path, model, fused=True)
    prompts = _prompts(n=6)
    got, _ = _generate(path, prompts)
    assert_greedy_equal(got, path, prompts, MAX_NEW)


@pytest.mark.slow
def test_torch_backend_equals_transformers(moe):
    prompts = _prompts(n=12)
    got, _ = _generate(moe, prompts)
    assert_greedy_equal(got, moe, prompts, MAX_NEW)


def test_sparse_and_dense_layers(moe):
    llm = LLM(moe, dtype="float32", num_kv_blocks=8)
    layers = llm.llm_engine.engine_core.engine_core.model.model.layers
    sparse = [isinstance(getattr(layer.mlp, "experts", None), FusedMoE) for layer in layers]
    assert sparse == ([True, False, True] if "qwen3_moe" in moe else [True, True, True])
    experts = layers[0].mlp.experts
    assert experts.renormalize and experts.top_k == 2
    llm.shutdown()


@pytest.mark.slow
def test_triton_backend_equals_transformers(moe):
    prompts = _prompts(n=3)  # interpreted kernels: a few short prompts
    got, _ = _generate(moe, prompts, attention_backend="triton", block_size=8, num_kv_blocks=32)
    assert_greedy_equal(got, moe, prompts, MAX_NEW)


@pytest.mark.slow
@pytest.mark.parametrize("setting", ["preemption", "chunked_prefill", "prefix_caching"])
def test_scheduling_settings_equal_transformers(qwen3_moe, setting):
    moe = qwen3_moe
    kwargs = dict(preemption=dict(num_kv_blocks=10, block_size=16), chunked_prefill=dict(max_num_batched_tokens=16),
                  prefix_caching=dict(enable_prefix_caching=True))[setting]
    prompts = _prompts(n=10, shared_prefix=32 if setting == "prefix_caching" else 0)
    got, stats = _generate(moe, prompts, **kwargs)
    if setting == "preemption":
        assert stats.num_preemptions > 0
    assert_greedy_equal(got, moe, prompts, MAX_NEW)


@pytest.mark.slow
def test_tensor_parallel_equals_transformers(qwen3_moe):
    moe = qwen3_moe
    prompts = _prompts(n=8)
    got, _ = _generate(moe, prompts, tensor_parallel_size=2)
    assert_greedy_equal(got, moe, prompts, MAX_NEW)


@pytest.mark.slow
def test_core_in_its_own_process(moe):
    from engine.engine.async_llm import AsyncLLM

    prompts = _prompts(n=4)
    llm = AsyncLLM(engine_config(moe, dtype="float32")).start()

    async def one(i, p):
        return [o async for o in llm.generate({"prompt_token_ids": p}, GREEDY, f"r{i}")][-1].outputs[0].token_ids

    async def run():
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

    try:
        assert llm.core_pid is not None
        got = asyncio.run(run())
    finally:
        llm.stop()
    assert_greedy_equal(got, moe, prompts, MAX_NEW)


def test_missing_expert_is_named(tmp_path):
    from safetensors.torch import save_file

    model = _hf_model("mixtral")
    path = _save(tmp_path, model, fused=False)
    from safetensors import safe_open
    with safe_open(f"{path}/model.safetensors", "pt") as f:
        state = {k: f.get_tensor(k) for k in f.keys() if k != "model.layers.2.block_sparse_moe.experts.3.w3.weight"}
    save_file(state, f"{path}/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing weights of model.layers.2.mlp.experts: \['expert 3 w3'\]"):
        LLM(path, dtype="float32", num_kv_blocks=8)


def _recorded(moe, prompts, profile=False, **kwargs):
    hooks, events = Hooks(), []
    hooks.subscribe(lambda *e: events.append(e), lambda evs, at_ns=None: events.extend(evs))
    llm = LLM(moe, dtype="float32", hooks=hooks, **kwargs)
    if profile:
        llm.start_profile()
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.shutdown()
    return events


def _routing(events) -> dict[int, dict[int, dict]]:
    out: dict[int, dict[int, dict]] = {}
    for layer, name, _, _, step, a in events:
        if (layer, name) == (MODEL_RUNNER, ROUTING):
            out.setdefault(step, {})[a["layer_idx"]] = a
    return out


def test_routing_is_traced_per_layer_per_step(moe):
    prompts = [list(range(10, 30)), list(range(40, 47))]
    events = _recorded(moe, prompts)
    batches = {e[4]: e[5] for e in events if (e[0], e[1]) == (MODEL_RUNNER, BATCH)}
    routing = _routing(events)
    assert set(routing) == set(batches) and len(routing) == 3  # the prefill and two decode steps
    sparse = [0, 2] if "qwen3_moe" in moe else [0, 1, 2]
    for step, layers in routing.items():
        tokens, rids = len(batches[step]["input_ids"]), batches[step]["request_ids"]
        assert sorted(layers) == sparse
        for a in layers.values():
            assert a["top_k"] == 2 and len(a["expert_counts"]) == a["num_experts"]
            assert sum(a["expert_counts"]) == 2 * tokens and a["rank_counts"] == [2 * tokens]
            assert list(a["topk_ids"]) == rids and sum(len(v) for v in a["topk_ids"].values()) == tokens
            rows = [row for r in rids for row in a["topk_ids"][r]]
            assert all(len(set(row)) == 2 for row in rows)
            flat = [e for row in rows for e in row]
            assert [flat.count(e) for e in range(a["num_experts"])] == a["expert_counts"]
            weights = [row for r in rids for row in a["topk_weights"][r]]
            assert all(abs(sum(row) - 1) < 1e-3 and row[0] >= row[1] for row in weights)  # renormalised, best first


def test_profile_counts_the_experts_used(moe):
    events = _recorded(moe, [list(range(10, 30))], profile=True)
    routing = _routing(events)
    launches = [(e[4], e[5]) for e in events if (e[0], e[1]) == (KERNEL, "fused_moe_ref")]
    assert launches
    for step, a in launches:
        used = sum(c > 0 for c in routing[step][a["layer_idx"]]["expert_counts"])
        assert a["meta"]["experts_used"] == used and a["op"] == "matmul"
        (t, h), (_, i2, _) = a["args"]["hidden_states"][0], a["args"]["w13"][0]
        weights = used * (i2 * h + h * i2 // 2) * 4
        assert a["flops"] == 2 * t * (2 * h * i2 + 5 * i2 // 2 + i2 * h + h) + t * h
        assert a["bytes"] == 2 * t * h * 4 + weights + t * 2 * (8 + 4)  # hidden in and out, used experts, routing


@pytest.mark.slow
def test_triton_launches_carry_their_expert_blocks(moe):
    events = _recorded(moe, [list(range(10, 20))], attention_backend="triton", block_size=8, num_kv_blocks=16)
    routing = _routing(events)
    launches = [(e[1], e[4], e[5]) for e in events if e[0] == KERNEL and e[1].startswith("fused_moe")]
    assert {n for n, *_ in launches} == {"fused_moe_w13", "fused_moe_w2"}
    for _, step, a in launches:
        counts = routing[step][a["layer_idx"]]["expert_counts"]
        bm = a["meta"]["BLOCK_SIZE_M"]
        assert a["meta"]["expert_blocks"] == [-(-c // bm) for c in counts]
        assert a["meta"]["experts_used"] == sum(c > 0 for c in counts)
        assert a["meta"]["padding_rows"] == sum(-(-c // bm) * bm - c for c in counts)
        assert a["grid"][0] >= sum(a["meta"]["expert_blocks"])


def test_expert_parallel_equals_transformers_with_disjoint_experts(qwen3_moe):
    moe = qwen3_moe
    hooks, events = Hooks(), []
    hooks.subscribe(lambda *e: events.append(e), lambda evs, at_ns=None: events.extend(evs))
    prompts = _prompts(n=6)
    llm = LLM(moe, dtype="float32", tensor_parallel_size=2, enable_expert_parallel=True, hooks=hooks)
    try:
        ranks = llm.llm_engine.engine_core.engine_core.model_executor.ranks
        e = 8 if "qwen3_moe" in moe else 4
        assert [r["experts"] for r in ranks] == [[0, e // 2], [e // 2, e]]  # E/N whole experts a rank, disjoint
        assert all(r["expert_parallel"] for r in ranks)
        assert ranks[0]["params"] < ranks[0]["model_params"]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        stats = llm.llm_engine.stats()
    finally:
        llm.shutdown()
    assert_greedy_equal([o.outputs[0].token_ids for o in outs], moe, prompts, MAX_NEW)
    load: dict[int, list[int]] = {}  # the engine's expert load equals the routing events' counts, summed
    for a in (e[5] for e in events if (e[0], e[1]) == (MODEL_RUNNER, ROUTING)):
        load[a["layer_idx"]] = [x + y for x, y in zip(load.get(a["layer_idx"], [0] * e), a["expert_counts"])]
    assert stats.moe_expert_tokens == {str(k): v for k, v in load.items()} and stats.moe_ep_size == 2
    exchanges = [(e[1], e[5]["meta"]["site"]) for e in events if e[0] == KERNEL and e[5]["meta"].get("site")
                 == "mlp.experts"]
    assert {name for name, _ in exchanges} == {"all_gather", "reduce_scatter"}  # dispatch; combine
    assert not any(e[1] == "all_reduce" and e[5]["meta"].get("site") == "mlp.experts" for e in events)
    for a in (e[5] for e in events if (e[0], e[1]) == (MODEL_RUNNER, ROUTING)):  # each rank's expert load
        counts, half = a["expert_counts"], a["num_experts"] // 2
        assert a["rank_counts"] == [sum(counts[:half]), sum(counts[half:])]


def test_all2all_backend_is_checked():
    from engine.config import ConfigError

    with pytest.raises(ConfigError, match="all2all_backend must be one of .'allgather_reducescatter',."):
        engine_config("tiny-gpt2", all2all_backend="pplx")


def test_a_held_fused_moe_launch_reruns_on_triton(moe):
    """The TUI's `t`: held before a fused-MoE reference call, its inputs run through the Triton
    grouped GEMMs, whose programs each read one expert; the outputs agree."""
    hooks, reruns = Hooks(), []

    def gate(point, info):
        if point == KERNEL and info["name"] == "fused_moe_ref" and not reruns:
            reruns.append(llm.llm_engine.engine_core.engine_core.held_attention_on_triton())

    llm = LLM(moe, dtype="float32", hooks=hooks, num_kv_blocks=8)
    try:
        hooks.add_gate(gate)
        llm.generate([{"prompt_token_ids": list(range(10, 22))}], SamplingParams(temperature=0, max_tokens=1),
                     use_tqdm=False)
    finally:
        llm.shutdown()
    (r,) = reruns
    assert r["name"] == "fused_moe_w13" and [x["name"] for x in r["launches"]] == ["fused_moe_w13", "fused_moe_w2"]
    assert r["max_abs_diff"] < 1e-4 and r["num_tokens"] == 12
    used = {p["blocks"][0] for p in r["programs"]}
    assert len(used) == r["meta"]["experts_used"] and sum(r["meta"]["expert_blocks"]) == len(r["programs"])
