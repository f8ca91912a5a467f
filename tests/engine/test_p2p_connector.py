"""P2pZmqConnector: a prefill instance keeps a finished request's blocks and answers kv_transfer_params;
a decode instance pulls those blocks over ZMQ and computes only the prompt's last token; the prefill
instance then frees them. Greedy output equals one plain instance's and transformers'. A pull that
fails (the prefill instance is gone) has the decode instance compute the prompt itself; blocks nobody
pulls are freed after abort_timeout_s. Two engines in one process, each with its own ZMQ sockets."""
from __future__ import annotations

import random
import socket
import time

import pytest

from engine import LLM, SamplingParams
from engine.builtin_model import LLAMA_NAME, NAME, builtin_path
from engine.hooks import Hooks
from engine.trace_names import BATCH, KV_RECV, KV_SEND, KV_TRANSFER, MODEL_RUNNER
from tests.engine.hf_reference import assert_greedy_equal

MAX_NEW = 6
BLOCK = 16
LENGTHS = [1, 5, 17, 33, 40]
WAIT_S = 60  # a bound on waiting for a condition (never reached unless broken)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _prompts() -> list[list[int]]:
    rng = random.Random(45)
    return [[rng.randrange(256) for _ in range(n)] for n in LENGTHS]


def _engine(model: str, role: str, events: list, async_scheduling: bool = True, **extra) -> LLM:
    hooks = Hooks()
    hooks.subscribe(lambda layer, name, kind, rid, step, attrs: events.append((name, rid, attrs))
                    if layer == KV_TRANSFER or (layer, name) == (MODEL_RUNNER, BATCH) else None)
    kv = {"kv_connector": "P2pZmqConnector", "kv_role": role,
          "kv_connector_extra_config": {"kv_port": _free_port(), **extra}}
    return LLM(model, hooks=hooks, num_kv_blocks=64, block_size=BLOCK, async_scheduling=async_scheduling,
               kv_transfer_config=kv)


def _prefill(llm: LLM, prompts) -> list:
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True,
                            extra_args={"kv_transfer_params": {"do_remote_decode": True}})
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def _decode(llm: LLM, prompts, prefilled) -> list:
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True,
                             extra_args={"kv_transfer_params": o.kv_transfer_params}) for o in prefilled]
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def _core(llm: LLM):
    return llm.llm_engine.engine_core.engine_core


def _step_until_freed(llm: LLM) -> None:
    core, t0 = _core(llm), time.monotonic()
    while core.scheduler.has_unfinished_requests() and time.monotonic() - t0 < WAIT_S:
        core.step_fn()
    stats = core.stats()
    assert stats.num_free_blocks == stats.num_total_blocks, "the prefill instance kept blocks"


def _computed(events, rid: str) -> int:
    return sum(a["query_start_loc"][i + 1] - a["query_start_loc"][i] for name, _, a in events if name == BATCH
               for i, r in enumerate(a["request_ids"]) if r == rid)


@pytest.mark.slow
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("model", [NAME, LLAMA_NAME])
def test_decode_instance_pulls_the_prompt_and_computes_one_token(model, async_scheduling):
    prompts = _prompts()
    plain = LLM(model, num_kv_blocks=64, block_size=BLOCK, async_scheduling=async_scheduling).generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0.0, max_tokens=MAX_NEW,
                                                                   ignore_eos=True), use_tqdm=False)
    p_events, d_events = [], []
    prefill = _engine(model, "kv_producer", p_events, async_scheduling)
    decode = _engine(model, "kv_consumer", d_events, async_scheduling)
    try:
        prefilled = _prefill(prefill, prompts)
        for o, p in zip(prefilled, prompts):
            params = o.kv_transfer_params
            assert params["do_remote_prefill"] and params["remote_port"] == prefill.llm_engine.engine_core \
                .engine_core.scheduler.connector.port
            assert len(params["remote_block_ids"]) == -(-len(p) // BLOCK)
        assert _core(prefill).stats().num_free_blocks < _core(prefill).stats().num_total_blocks  # kept
        decoded = _decode(decode, prompts, prefilled)
        _step_until_freed(prefill)
    finally:
        prefill.shutdown()
        decode.shutdown()
    got = [o.outputs[0].token_ids for o in decoded]
    assert got == [o.outputs[0].token_ids for o in plain]
    assert_greedy_equal(got, str(builtin_path(model)), prompts, MAX_NEW)
    recv = {rid: a for name, rid, a in d_events if name == KV_RECV}
    sent = {rid: a for name, rid, a in p_events if name == KV_SEND}
    for o, p, pre in zip(decoded, prompts, prefilled):
        assert o.num_cached_tokens == len(p) - 1
        # the decode instance computed the prompt's last token, then each output token but the last
        assert _computed(d_events, o.request_id) == 1 + MAX_NEW - 1
        assert len(recv[o.request_id]["block_ids"]) == -(-(len(p) - 1) // BLOCK)
        assert recv[o.request_id]["bytes"] == sent[pre.request_id]["bytes"]


@pytest.mark.slow
def test_a_failed_pull_computes_the_prompt_instead():
    prompts = _prompts()[2:]
    events = []
    prefill = _engine(NAME, "kv_producer", [])
    decode = _engine(NAME, "kv_consumer", events, timeout_s=5)
    try:
        prefilled = _prefill(prefill, prompts)
    finally:
        prefill.shutdown()  # gone before the pull
    try:
        decoded = _decode(decode, prompts, prefilled)
        stats = _core(decode).stats()
        assert stats.num_free_blocks == stats.num_total_blocks
    finally:
        decode.shutdown()
    want = LLM(NAME, num_kv_blocks=64, block_size=BLOCK).generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0.0, max_tokens=MAX_NEW,
                                                                   ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in decoded] == [o.outputs[0].token_ids for o in want]
    assert not [e for e in events if e[0] == KV_RECV]
    for o, p in zip(decoded, prompts):
        assert o.num_cached_tokens == 0
        assert _computed(events, o.request_id) == len(p) + MAX_NEW - 1


def test_blocks_nobody_pulls_are_freed_after_the_abort_timeout():
    prefill = _engine(NAME, "kv_producer", [], abort_timeout_s=0.2)
    try:
        _prefill(prefill, _prompts()[2:])
        assert _core(prefill).scheduler.has_unfinished_requests()  # the blocks wait for their pull
        _step_until_freed(prefill)
    finally:
        prefill.shutdown()


def test_a_finished_request_without_do_remote_decode_frees_its_blocks_at_once():
    prefill = _engine(NAME, "kv_producer", [])
    try:
        out = prefill.generate([{"prompt_token_ids": _prompts()[3]}], SamplingParams(max_tokens=2), use_tqdm=False)
        assert out[0].kv_transfer_params is None
        assert not _core(prefill).scheduler.has_unfinished_requests()
    finally:
        prefill.shutdown()


@pytest.mark.slow
def test_a_request_aborted_while_its_kv_is_on_its_way_keeps_its_blocks_until_it_arrives():
    """The worker writes into the blocks of a request waiting for remote KV: they stay allocated after an
    abort until the pull is over (here: it fails, nobody listens), then they are freed."""
    decode = _engine(NAME, "kv_consumer", [], timeout_s=2)
    core = _core(decode)
    try:
        nobody = {"do_remote_prefill": True, "remote_engine_id": "x", "remote_request_id": "r",
                  "remote_block_ids": [1, 2, 3], "remote_host": "127.0.0.1", "remote_port": _free_port()}
        params = SamplingParams(temperature=0.0, max_tokens=2, extra_args={"kv_transfer_params": nobody})
        decode.llm_engine.add_request("a", {"prompt_token_ids": _prompts()[4]}, params)
        decode.llm_engine.step()
        req = core.scheduler.requests["a"]
        assert req.status.name == "WAITING_FOR_REMOTE_KVS" and req.block_ids
        decode.llm_engine.abort_request(["a"])
        assert core.scheduler.has_unfinished_requests()  # its blocks are still the worker's
        assert core.stats().num_free_blocks < core.stats().num_total_blocks
        _step_until_freed(decode)
    finally:
        decode.shutdown()


def test_a_taken_kv_port_is_one_clear_error():
    port = _free_port()
    kv = {"kv_connector": "P2pZmqConnector", "kv_role": "kv_producer", "kv_connector_extra_config": {"kv_port": port}}
    first = LLM(NAME, num_kv_blocks=16, kv_transfer_config=kv)
    try:
        with pytest.raises(RuntimeError, match=f"cannot listen on 127.0.0.1:{port} .*set \"kv_port\""):
            LLM(NAME, num_kv_blocks=16, kv_transfer_config=kv)
    finally:
        first.shutdown()
