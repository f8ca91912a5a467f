"""The KV-connector API (engine/distributed/kv_transfer) through ExampleConnector: a producer instance
saves each prompt's blocks to files, a consumer instance loads them into its own blocks layer by
layer, and its prefill computes only the tokens not delivered. Greedy output equals one plain
instance's and transformers', sync and async scheduling; the consumer's computed tokens are read
from its trace (the model runner's batch events) and its outputs' num_cached_tokens."""
from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from engine.arg_utils import EngineArgs
from engine.builtin_model import LLAMA_NAME, NAME, builtin_path
from engine.config import ConfigError
from engine.hooks import Hooks
from engine.trace_names import BATCH, KV_LOAD, KV_SAVE, KV_TRANSFER, MODEL_RUNNER
from tests.engine.hf_reference import assert_greedy_equal

MAX_NEW = 8
BLOCK = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
LENGTHS = [1, 5, 17, 33, 40]  # no full block to deliver, one block and a bit, several blocks


def _prompts() -> list[list[int]]:
    rng = random.Random(44)
    return [[rng.randrange(256) for _ in range(n)] for n in LENGTHS]


def _kv(role: str, path) -> dict:
    return {"kv_connector": "ExampleConnector", "kv_role": role,
            "kv_connector_extra_config": {"shared_storage_path": str(path)}}


def _generate(model: str, prompts, **kwargs):
    """Greedy outputs of a fresh engine, its trace events (kv_transfer and batch), no block leaked."""
    events = []
    hooks = Hooks()
    hooks.subscribe(lambda layer, name, kind, rid, step, attrs: events.append((layer, name, rid, attrs))
                    if layer == KV_TRANSFER or (layer, name) == (MODEL_RUNNER, BATCH) else None)
    llm = LLM(model, hooks=hooks, num_kv_blocks=64, block_size=BLOCK, **kwargs)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    stats = llm.llm_engine.engine_core.engine_core.stats()
    assert stats.num_free_blocks == stats.num_total_blocks, "blocks leaked"
    return outs, events


def _computed_per_request(events) -> dict[str, int]:
    """Request id -> tokens its forward passes computed in prefill (rows of the batch events, before the
    request's first sampled token: the prompt's rows)."""
    computed: dict[str, int] = {}
    for layer, name, _, attrs in events:
        if name != BATCH:
            continue
        qsl = attrs["query_start_loc"]
        for i, rid in enumerate(attrs["request_ids"]):
            computed.setdefault(rid, 0)
            computed[rid] += qsl[i + 1] - qsl[i]
    return computed


@pytest.mark.slow
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("model", [NAME, LLAMA_NAME])
def test_consumer_loads_what_the_producer_saved(tmp_path, model, async_scheduling):
    prompts = _prompts()
    plain, _ = _generate(model, prompts, async_scheduling=async_scheduling)
    produced, p_events = _generate(model, prompts, async_scheduling=async_scheduling,
                                   kv_transfer_config=_kv("kv_producer", tmp_path))
    consumed, c_events = _generate(model, prompts, async_scheduling=async_scheduling,
                                   kv_transfer_config=_kv("kv_consumer", tmp_path))
    got = [[o.outputs[0].token_ids for o in outs] for outs in (plain, produced, consumed)]
    assert got[0] == got[1] == got[2]
    assert_greedy_equal(got[2], str(builtin_path(model)), prompts, MAX_NEW)

    delivered = [(n - 1) // BLOCK * BLOCK for n in LENGTHS]
    saves = {rid: a for layer, name, rid, a in p_events if name == KV_SAVE}
    loads = {rid: a for layer, name, rid, a in c_events if name == KV_LOAD}
    for out, n, d in zip(consumed, LENGTHS, delivered):
        rid = out.request_id
        assert out.num_cached_tokens == d
        if d:
            assert len(loads[rid]["block_ids"]) == len(saves[rid]["block_ids"]) == d // BLOCK
            assert loads[rid]["bytes"] == saves[rid]["bytes"] > 0
        else:
            assert rid not in loads and rid not in saves
    # the consumer's forward passes computed the prompt's undelivered tokens, then one per output token
    # but the last (it is sampled, not fed back)
    computed = _computed_per_request(c_events)
    assert [computed[o.request_id] for o in consumed] == [n - d + MAX_NEW - 1 for n, d in zip(LENGTHS, delivered)]
    produced_computed = _computed_per_request(p_events)
    assert [produced_computed[o.request_id] for o in produced] == [n + MAX_NEW - 1 for n in LENGTHS]


def test_a_prefix_hit_loads_only_the_blocks_past_it(tmp_path):
    """The consumer's own prefix cache holds the first block: only the second is loaded."""
    prompts = _prompts()[3:4]  # 33 tokens: two full blocks to deliver
    _generate(NAME, prompts, kv_transfer_config=_kv("kv_producer", tmp_path))
    llm = LLM(NAME, num_kv_blocks=64, block_size=BLOCK, kv_transfer_config=_kv("kv_consumer", tmp_path))
    # its first block, computed here (no file holds a one-block prefix) and kept in the prefix cache
    llm.generate([{"prompt_token_ids": prompts[0][:BLOCK + 1]}], GREEDY, use_tqdm=False)
    core = llm.llm_engine.engine_core.engine_core
    events = []
    core.hooks.subscribe(lambda layer, name, kind, rid, step, attrs: events.append((name, attrs))
                         if layer == KV_TRANSFER else None)
    out = llm.generate([{"prompt_token_ids": prompts[0]}], GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 2 * BLOCK
    assert [(name, len(a["block_ids"])) for name, a in events] == [(KV_LOAD, 1)]


def test_kv_transfer_config_errors_are_one_line():
    with pytest.raises(ConfigError, match="unknown kv_connector 'Nope'; known: ExampleConnector"):
        LLM(NAME, kv_transfer_config={"kv_connector": "Nope"})
    with pytest.raises(ConfigError, match="kv_role must be one of"):
        LLM(NAME, kv_transfer_config={"kv_connector": "ExampleConnector", "kv_role": "both"})
    with pytest.raises(ConfigError, match="kv_transfer_config must be a JSON object"):
        EngineArgs(kv_transfer_config="{not json").create_engine_config()
    import argparse
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser(exit_on_error=False))
    with pytest.raises(argparse.ArgumentError, match="kv_transfer_config must be a JSON object"):
        parser.parse_args(["--kv-transfer-config", "{nope"])
    args = parser.parse_args(["--kv-transfer-config", '{"kv_connector": "ExampleConnector"}'])
    assert EngineArgs.from_cli_args(args).create_engine_config().kv_transfer_config.kv_role == "kv_both"


def test_no_connector_no_metadata():
    llm = LLM(NAME, num_kv_blocks=32)
    core = llm.llm_engine.engine_core.engine_core
    assert core.scheduler.connector is None and core.model_runner.kv_connector is None
    assert core.scheduler.schedule().kv_connector_metadata is None
