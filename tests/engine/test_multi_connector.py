"""MultiConnector across several connectors, by vLLM V1's rules (multi_connector.py): every connector is asked
for every request and the first that can deliver its tokens loads them (the others get its blocks with 0 tokens
to load); each step's metadata is one per connector, in order; a finished request's blocks are kept while any
connector keeps them, and the connectors' kv_transfer_params are merged. Greedy output equals a plain engine's."""
from __future__ import annotations

import random
import socket

import pytest

from engine import LLM, SamplingParams
from engine.arg_utils import engine_config
from engine.builtin_model import NAME
from engine.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from engine.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from engine.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector
from engine.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector, MultiKVConnectorMetadata
from engine.hooks import Hooks
from engine.outputs import KVConnectorOutput
from engine.request import Request, RequestStatus
from engine.trace_names import KV_LOAD, KV_RECV, KV_TRANSFER

BLOCK = 16
MAX_NEW = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


def _prompts(n: int, length: int = 40) -> list[list[int]]:
    rng = random.Random(47)
    return [[rng.randrange(256) for _ in range(length)] for _ in range(n)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _files(path, role: str) -> dict:
    return {"kv_connector": "ExampleConnector", "kv_role": role, "kv_connector_extra_config": {"shared_storage_path":
                                                                                                 str(path)}}


def _multi(*connectors: dict, role: str = "kv_both") -> dict:
    return {"kv_connector": "MultiConnector", "kv_role": role, "kv_connector_extra_config": {"connectors": connectors}}


def _llm(kv: dict, events: list | None = None, num_kv_blocks: int = 64) -> LLM:
    hooks = Hooks()
    if events is not None:
        hooks.subscribe(lambda layer, name, kind, rid, step, attrs: events.append((name, rid, attrs))
                        if layer == KV_TRANSFER else None)
    return LLM(NAME, hooks=hooks, num_kv_blocks=num_kv_blocks, block_size=BLOCK, kv_transfer_config=kv)


def _generate(llm: LLM, prompts, params=GREEDY) -> list:
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def _plan(llm: LLM) -> list[MultiKVConnectorMetadata]:
    """Every step's connector metadata from now on, as the scheduler side built it."""
    multi, plans = llm.llm_engine.engine_core.engine_core.scheduler.connector, []
    build = multi.build_connector_meta
    multi.build_connector_meta = lambda out: plans.append(build(out)) or plans[-1]
    return plans


def _core(llm: LLM):
    return llm.llm_engine.engine_core.engine_core


def test_the_first_connector_that_has_a_prefix_loads_it(tmp_path):
    """[files in a/, files in b/, host memory]: a prompt saved in a/ only is loaded from a/, one in b/ only from b/,
    one in both from a/ (the first), one in neither is computed, then found in host memory once the device has
    dropped it. Every step's metadata has one entry per connector, in order."""
    only_a, only_b, both, neither = _prompts(4)
    _generate(_llm(_files(tmp_path / "a", "kv_producer")), [only_a, both])
    _generate(_llm(_files(tmp_path / "b", "kv_producer")), [only_b, both])
    events: list = []
    llm = _llm(_multi(_files(tmp_path / "a", "kv_consumer"), _files(tmp_path / "b", "kv_consumer"),
                      {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {"cpu_bytes": 64 * 65536}}),
               events)
    plans = _plan(llm)
    outs = [_generate(llm, [p])[0] for p in (only_a, only_b, both, neither)]
    assert llm.reset_prefix_cache()  # the device's tier empty: what hits now is the host's
    outs.append(_generate(llm, [neither])[0])

    assert all(isinstance(m, MultiKVConnectorMetadata) and len(m.metadata) == 3 for m in plans)
    loaded_by = [{r.req_id for m in plans for r in m.metadata[i].requests if not r.is_store} for i in range(2)]
    loaded_by.append({rid for m in plans for rid in m.metadata[2].reqs_to_load})
    ids = [o.request_id for o in outs]
    assert loaded_by == [{ids[0], ids[2]}, {ids[1]}, {ids[4]}]
    loads = [(rid, attrs["connector"], len(attrs["block_ids"])) for name, rid, attrs in events if name == KV_LOAD]
    assert loads == [(ids[0], "ExampleConnector", 2), (ids[1], "ExampleConnector", 2), (ids[2], "ExampleConnector", 2),
                     (ids[4], "OffloadingConnector", 2)]
    assert [o.num_cached_tokens for o in outs] == [32, 32, 32, 0, 32]
    plain = _generate(LLM(NAME, num_kv_blocks=64, block_size=BLOCK), [only_a, only_b, both, neither, neither])
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    stats = _core(llm).stats()
    assert stats.num_free_blocks == stats.num_total_blocks


@pytest.mark.slow
@pytest.mark.parametrize("first", ["p2p", "files"])
def test_blocks_kept_by_one_connector_and_params_merged(tmp_path, first):
    """A prefill instance with [P2P, files]: the request that asked do_remote_decode is kept (P2P keeps it, the
    files do not) and answers P2P's kv_transfer_params (the files answer none); its prompt is also saved to files.
    A decode instance with the pull first pulls the prompt and computes one token; with the files first it loads
    the prompt's whole blocks from them, and P2P, not chosen, still tells the prefill instance to free its blocks."""
    port = _free_port()
    p2p = {"kv_connector": "P2pZmqConnector", "kv_connector_extra_config": {"kv_port": port}}
    prefill = _llm(_multi(p2p, _files(tmp_path, "kv_producer"), role="kv_producer"))
    order = (p2p, _files(tmp_path, "kv_consumer")) if first == "p2p" else (_files(tmp_path, "kv_consumer"), p2p)
    events: list = []
    decode = _llm(_multi(*order, role="kv_consumer"), events)
    prompts = _prompts(3, 37)
    try:
        remote = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True,
                                extra_args={"kv_transfer_params": {"do_remote_decode": True}})
        prefilled = _generate(prefill, prompts, remote)
        assert all(o.kv_transfer_params["remote_port"] == port and o.kv_transfer_params["do_remote_prefill"]
                   for o in prefilled)
        assert _core(prefill).scheduler.has_unfinished_requests()  # the blocks wait for their pull
        decoded = _generate(decode, prompts, [SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True,
                                                             extra_args={"kv_transfer_params": o.kv_transfer_params})
                                              for o in prefilled])
        core = _core(prefill)
        while core.scheduler.has_unfinished_requests():  # freed once pulled (at worst: the abort timeout)
            core.step_fn()
        assert core.stats().num_free_blocks == core.stats().num_total_blocks
    finally:
        prefill.shutdown()
        decode.shutdown()
    pulled = [a for name, _, a in events if name == KV_RECV and a["block_ids"]]
    loaded = [a for name, _, a in events if name == KV_LOAD]
    if first == "p2p":
        assert len(pulled) == 3 and not loaded
        assert [o.num_cached_tokens for o in decoded] == [36] * 3
    else:
        assert not pulled and [len(a["block_ids"]) for a in loaded] == [2] * 3
        assert [o.num_cached_tokens for o in decoded] == [32] * 3
    plain = _generate(LLM(NAME, num_kv_blocks=64, block_size=BLOCK), prompts)
    assert [o.outputs[0].token_ids for o in decoded] == [o.outputs[0].token_ids for o in plain]


class KeepingConnector(ExampleConnector):
    """An ExampleConnector that also keeps a finished request's blocks (as a connector saving them
    asynchronously does) and answers where it saves them."""

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict | None]:
        super().request_finished(request, block_ids)
        return True, {"saved_in": self.storage_path}


def test_finished_requests_params_merged_and_blocks_kept_until_every_connector_sent_them(tmp_path, monkeypatch):
    """The scheduler side alone: [P2P, a connector that keeps blocks too] answers both connectors' kv_transfer_params
    and reports the request sent only once both have sent it; two connectors answering the same keys is an error."""
    monkeypatch.setitem(KVConnectorFactory._registry, "KeepingConnector", (__name__, "KeepingConnector"))
    p2p = {"kv_connector": "P2pZmqConnector", "kv_connector_extra_config": {"kv_port": 5555}}
    keeping = {"kv_connector": "KeepingConnector", "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)}}
    multi = MultiConnector(engine_config(NAME, kv_transfer_config=_multi(p2p, keeping, role="kv_producer")),
                           KVConnectorRole.SCHEDULER)
    req = Request("r", None, [1, 2, 3], SamplingParams(max_tokens=1), None, 1,
                  kv_transfer_params={"do_remote_decode": True})
    req.status = RequestStatus.FINISHED_LENGTH
    delay, params = multi.request_finished(req, [1])
    assert delay and params["remote_port"] == 5555 and params["saved_in"] == str(tmp_path)
    sent = KVConnectorOutput(finished_sending={"r"})
    multi.update_connector_output(sent)  # one of the two has sent the blocks: they stay
    assert sent.finished_sending is None
    sent = KVConnectorOutput(finished_sending={"r"})
    multi.update_connector_output(sent)
    assert sent.finished_sending == {"r"}

    clash = MultiConnector(engine_config(NAME, kv_transfer_config=_multi(p2p, p2p, role="kv_producer")),
                           KVConnectorRole.SCHEDULER)
    with pytest.raises(RuntimeError, match="the same kv_transfer_params"):
        clash.request_finished(req, [1])
