"""Watching the KV move: two in-process instances, a prefill one and a decode one, joined by the
P2pZmqConnector and each recording its trace. The request detail on the decode side says its prompt's
KV was received from the prefill engine (the bytes and time of the engine's own recv event) and that
its prefill computed one token; the fold keeps every kv_transfer event as traced; the merged Perfetto
export puts each instance in its process on one clock and links each prefill to its decode. With a
host-memory tier (--kv-offloading-size) the KV-cache panel shows the tier's counts, which equal the
trace's saves and loads and the engine's own cached-token count."""
from __future__ import annotations

import json
import random
import time
from types import SimpleNamespace

import pytest

from engine import LLM, Hooks, SamplingParams
from engine.builtin_model import NAME
from engine.trace_names import ENGINE, KV_LOAD, KV_RECV, KV_SAVE, KV_SEND, KV_TRANSFER, QUEUED
from tests.engine.test_p2p_connector import _free_port
from tests.tracer.chrome_check import check_chrome_trace
from tests.tui.helpers import shown
from tracer.cli import main
from tracer.events import read_trace
from tracer.export import export_merged
from tracer.session import TraceSession
from tracer.state import offload_tier, prompt_sources
from tracer.tui.app import TraceApp
from tracer.tui.fmt import fmt_bytes, plural
from tracer.tui.screens.request import RequestScreen
from tracer.tui.sources.replay import ReplaySource
from tracer.tui.widgets.request_detail import RequestDetail

BLOCK = 16
LENGTHS = [40, 17]
MAX_NEW = 3
WAIT_S = 60  # a bound on waiting for a condition (never reached unless broken)


def _prompts(lengths, seed: int = 44) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(n)] for n in lengths]


def _p2p(hooks: Hooks, role: str) -> LLM:
    kv = {"kv_connector": "P2pZmqConnector", "kv_role": role, "kv_connector_extra_config": {"kv_port": _free_port()}}
    return LLM(NAME, hooks=hooks, num_kv_blocks=64, block_size=BLOCK, kv_transfer_config=kv)


def _core(llm: LLM):
    return llm.llm_engine.engine_core.engine_core


@pytest.fixture(scope="module")
def disagg(tmp_path_factory):
    """A prefill instance and a decode instance, each recording: the decode instance's request ids are
    not the prefill instance's (a first plain request moves them on), as on two servers."""
    folder = tmp_path_factory.mktemp("disagg")
    p_trace, d_trace = folder / "prefill.trace", folder / "decode.trace"
    p_hooks, d_hooks = Hooks(), Hooks()
    p_session = TraceSession(p_hooks, trace_file=p_trace, control=False, model=NAME)
    d_session = TraceSession(d_hooks, trace_file=d_trace, control=False, model=NAME)
    prefill, decode = _p2p(p_hooks, "kv_producer"), _p2p(d_hooks, "kv_consumer")
    prompts = _prompts(LENGTHS)
    try:
        decode.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=1), use_tqdm=False)
        prefill_params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True,
                                        extra_args={"kv_transfer_params": {"do_remote_decode": True}})
        prefilled = prefill.generate([{"prompt_token_ids": p} for p in prompts], prefill_params, use_tqdm=False)
        decode_params = [SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True,
                                        extra_args={"kv_transfer_params": o.kv_transfer_params}) for o in prefilled]
        decoded = decode.generate([{"prompt_token_ids": p} for p in prompts], decode_params, use_tqdm=False)
        core, t0 = _core(prefill), time.monotonic()
        while core.scheduler.has_unfinished_requests() and time.monotonic() - t0 < WAIT_S:
            core.step_fn()  # its blocks are freed once pulled: the steps that publish its sends
        engine_id, d_engine_id = core.scheduler.connector.engine_id, _core(decode).scheduler.connector.engine_id
        p_state, d_state = p_session.state.view(), d_session.state.view()
    finally:
        prefill.shutdown()
        decode.shutdown()
        p_session.close()
        d_session.close()
    return SimpleNamespace(p_trace=p_trace, d_trace=d_trace, p_state=p_state, d_state=d_state, prompts=prompts,
                           prefilled=prefilled, decoded=decoded, engine_id=engine_id, d_engine_id=d_engine_id)


def kv_events(path, kind: str | None = None) -> list:
    return [e for e in read_trace(path)[1] if e.layer == KV_TRANSFER and (kind is None or e.name == kind)]


@pytest.mark.slow
def test_the_fold_keeps_every_transfer_and_where_the_prompt_came_from(disagg):
    for state, path in ((disagg.p_state, disagg.p_trace), (disagg.d_state, disagg.d_trace)):
        traced = sorted((e.request_id, e.name, e.attrs["block_ids"], e.attrs["bytes"]) for e in kv_events(path))
        folded = sorted((rid, t["kind"], t["block_ids"], t["bytes"]) for rid, r in state.requests.items()
                        for t in r.kv_transfers)
        assert traced and folded == traced
    for o, pre, p in zip(disagg.decoded, disagg.prefilled, disagg.prompts):
        r, sent = disagg.d_state.requests[o.request_id], disagg.p_state.requests[pre.request_id]
        assert o.num_cached_tokens == len(p) - 1  # the engine's own count of the tokens it did not compute
        src = prompt_sources(r)
        assert (src["hit"], src["delivered"], src["computed"]) == (0, len(p) - 1, 1)
        assert r.kv_transfer_params["remote_request_id"] == pre.request_id != o.request_id
        assert sent.kv_transfer_params == {"do_remote_decode": True}
        assert [t["kind"] for t in sent.kv_transfers] == [KV_SEND] and [t["kind"] for t in r.kv_transfers] == [KV_RECV]
        assert sent.kv_transfers[0]["bytes"] == r.kv_transfers[0]["bytes"] > 0
        assert r.kv_transfers[0]["step"] < src["step"]  # received while it waited, then its one-token prefill
        assert [prompt_sources(sent)[k] for k in ("hit", "delivered", "computed")] == [0, 0, len(p)]


@pytest.mark.asyncio
async def test_the_decode_sides_request_detail_says_what_it_received_and_computed(disagg):
    o, pre, p = disagg.decoded[0], disagg.prefilled[0], disagg.prompts[0]
    recv = next(e for e in kv_events(disagg.d_trace, KV_RECV) if e.request_id == o.request_id)
    source = ReplaySource.load(disagg.d_trace)
    source.replay.goto(recv.step)  # the step whose end traced it: the Log shows its line
    app = TraceApp(source, initial_pane="log")
    async with app.run_test(size=(200, 60)) as pilot:
        app.tick()
        await pilot.pause()
        app.log_panel.apply_filter("kv_transfer")  # its lines only (a refresh draws the newest 100 events)
        log = "\n".join(app.query_one("#log-lines").plain_lines)
        assert f"kv_transfer recv step={recv.step} request={o.request_id}" in log
        await source.travel("end")
        app.tick()
        app.push_screen(RequestScreen(o.request_id))
        await pilot.pause()
        text = app.screen.query_one(RequestDetail).text
    a = recv.attrs
    assert (f"prompt {len(p)} tokens: {len(p) - 1} received from engine {disagg.engine_id} in "
            f"{a['seconds'] * 1e3:.1f} ms ({fmt_bytes(a['bytes'])}), 1 computed") in text
    assert f"decode of request {pre.request_id}, prefilled by engine {disagg.engine_id} at 127.0.0.1:" in text
    row = next(line for line in text.splitlines() if line.strip().startswith("recv"))
    assert plural(len(a["block_ids"]), "block") in row and fmt_bytes(a["bytes"]) in row
    assert "P2pZmqConnector: " + " ".join(map(str, a["block_ids"])) in row
    assert "no prefix-cache hit" in text  # the received tokens count as cached in the engine, not as a hit


def test_the_prefill_sides_detail_says_its_blocks_wait_for_the_decode_instance(disagg):
    from tracer.tui.widgets.kv_transfer import kv_transfer_section

    pre, p = disagg.prefilled[0], disagg.prompts[0]
    send = next(e for e in kv_events(disagg.p_trace, KV_SEND) if e.request_id == pre.request_id)
    text = kv_transfer_section(disagg.p_state.requests[pre.request_id]).plain
    assert "prefill for a decode instance (do_remote_decode)" in text
    assert f"prompt {len(p)} tokens: {len(p)} computed" in text
    assert f" send step {send.step:<4} " in text and fmt_bytes(send.attrs["bytes"]) in text


def test_the_merged_export_has_a_process_per_instance_on_one_clock_and_links_each_prefill_to_its_decode(
        disagg, tmp_path):
    out = tmp_path / "merged.json"
    result = export_merged([disagg.p_trace, disagg.d_trace], out)
    chrome = json.loads(out.read_text())
    assert check_chrome_trace(chrome) == []
    evs = chrome["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in evs if e["ph"] == "M" and e["name"] == "process_name"}
    d_id = disagg.d_engine_id
    assert names == {1: f"{disagg.p_trace}: vllm-trace {NAME} (kv_producer, engine {disagg.engine_id})",
                     2: f"{disagg.d_trace}: vllm-trace {NAME} (kv_consumer, engine {d_id})"}
    traces = [read_trace(disagg.p_trace), read_trace(disagg.d_trace)]
    origin = min(h["wall_clock_start_ns"] for h, _ in traces)
    for pid, (header, events) in enumerate(traces, 1):  # each trace shifted by its wall-clock start
        for e in [e for e in events if (e.layer, e.name) == (ENGINE, QUEUED)]:
            track = next(x for x in evs if x["ph"] == "b" and x["pid"] == pid
                         and x["name"] == f"request {e.request_id}")
            assert track["id"] == f"{pid}:{e.request_id}"
            assert track["ts"] == (e.ts_ns + header["wall_clock_start_ns"] - origin) / 1000
    starts = {e["id"]: e for e in evs if e["ph"] == "s"}
    ends = {e["id"]: e for e in evs if e["ph"] == "f"}
    assert result.num_flows == len(starts) == len(ends) == len(disagg.prompts)
    assert {(s["args"]["prefill_request_id"], s["args"]["decode_request_id"]) for s in starts.values()} == {
        (pre.request_id, o.request_id) for pre, o in zip(disagg.prefilled, disagg.decoded)}
    for fid, s in starts.items():
        f = ends[fid]
        send = _slice(evs, 1, s["tid"], f"{KV_SEND} {s['args']['prefill_request_id']}")
        recv = _slice(evs, 2, f["tid"], f"{KV_RECV} {f['args']['decode_request_id']}")
        assert send["ts"] <= s["ts"] <= send["ts"] + send["dur"] and recv["ts"] <= f["ts"] <= recv["ts"] + recv["dur"]
        assert send["args"]["bytes"] == recv["args"]["bytes"] and f["bp"] == "e" and s["ts"] <= f["ts"]


def _slice(evs: list[dict], pid: int, tid: int, name: str) -> dict:
    return next(e for e in evs if e["ph"] == "X" and e["pid"] == pid and e["tid"] == tid and e["name"] == name)


def test_export_merges_the_traces_it_is_given(disagg, tmp_path, capsys):
    out = tmp_path / "merged.json"
    assert main(["export", str(disagg.p_trace), str(disagg.d_trace), "-o", str(out)]) == 0
    err = capsys.readouterr().err
    assert f"from 2 traces, a process each on one clock, {len(disagg.prompts)} requests linked" in err
    assert main(["export", str(disagg.p_trace), str(disagg.d_trace), "--roofline", str(tmp_path / "r.html")]) == 2
    assert "--roofline charts one trace" in capsys.readouterr().err


NUM_BLOCKS = 7  # 6 usable: one 40-token request at a time, each evicting the one before


@pytest.mark.slow
@pytest.mark.asyncio
async def test_the_kv_panel_shows_the_host_tier_and_the_detail_what_it_loaded(tmp_path):
    """A prompt evicted from the device (four others took its blocks) is loaded back from host memory."""
    a, *others = _prompts([40] * 5, seed=46)
    trace = tmp_path / "offload.trace"
    hooks = Hooks()
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    with TraceSession(hooks, trace_file=trace, control=False, model=NAME):
        llm = LLM(NAME, hooks=hooks, num_kv_blocks=NUM_BLOCKS, block_size=BLOCK, kv_offloading_size=0.01)
        outs = [llm.generate([{"prompt_token_ids": p}], greedy, use_tqdm=False)[0] for p in [a, *others, a]]
        num_cpu_blocks = _core(llm).scheduler.connector.num_cpu_blocks
        llm.shutdown()
    again = outs[-1]
    saves, loads = kv_events(trace, KV_SAVE), kv_events(trace, KV_LOAD)
    stored, loaded = sum(len(e.attrs["block_ids"]) for e in saves), sum(len(e.attrs["block_ids"]) for e in loads)
    assert again.num_cached_tokens == 32 and loaded == 2 and stored == 10  # two blocks of each prompt, both back
    source = ReplaySource.load(trace)
    await source.travel("end")
    tier = offload_tier(source.refresh())
    assert tier == dict(cpu_bytes=int(0.01 * 2 ** 30), num_cpu_blocks=num_cpu_blocks, num_held_blocks=stored,
                        num_stored_blocks=stored, num_hit_tokens=again.num_cached_tokens, num_loaded_blocks=loaded)
    app = TraceApp(source, initial_pane="kv")
    async with app.run_test(size=(200, 50)) as pilot:
        app.tick()
        await pilot.pause()
        summary = shown(app.query_one("#kv-summary"))
        app.push_screen(RequestScreen(again.request_id))
        await pilot.pause()
        text = app.screen.query_one(RequestDetail).text
    assert (f"host-memory tier (OffloadingConnector): {fmt_bytes(tier['cpu_bytes'])} = {num_cpu_blocks} blocks, "
            f"{stored} held · {stored} stored · 32 tokens hit, {loaded} loaded back") in summary
    load = loads[0].attrs
    assert loads[0].request_id == again.request_id
    assert (f"prompt 40 tokens: 32 loaded from host memory in {load['seconds'] * 1e3:.1f} ms "
            f"({fmt_bytes(load['bytes'])}), 8 computed") in text


@pytest.mark.slow
def test_a_consumer_of_the_example_connector_says_it_loaded_the_prompt_from_shared_storage(tmp_path):
    """ExampleConnector: a producer writes the prompt's blocks to files; a consumer loads them instead of
    computing them. Its detail names the load, with the bytes and time of the engine's load event."""
    from tracer.tui.widgets.kv_transfer import kv_transfer_section

    prompt = _prompts([40], seed=47)[0]
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    storage = {"shared_storage_path": str(tmp_path / "kv")}

    def run(role: str):
        hooks = Hooks()
        with TraceSession(hooks, control=False, model=NAME) as session:
            kv = {"kv_connector": "ExampleConnector", "kv_role": role, "kv_connector_extra_config": storage}
            llm = LLM(NAME, hooks=hooks, num_kv_blocks=16, block_size=BLOCK, kv_transfer_config=kv)
            out = llm.generate([{"prompt_token_ids": prompt}], greedy, use_tqdm=False)[0]
            llm.shutdown()
            return out, session.state.view().requests[out.request_id]

    _, saved = run("kv_producer")
    out, loaded = run("kv_consumer")
    assert [t["kind"] for t in saved.kv_transfers] == [KV_SAVE]
    assert [t["kind"] for t in loaded.kv_transfers] == [KV_LOAD]
    load = loaded.kv_transfers[0]
    assert out.num_cached_tokens == 32  # the engine's count: the prompt's 39 tokens, rounded down to whole blocks
    text = kv_transfer_section(loaded).plain
    assert (f"prompt 40 tokens: 32 loaded from shared storage in {load['seconds'] * 1e3:.1f} ms "
            f"({fmt_bytes(load['bytes'])}), 8 computed") in text
    assert load["bytes"] == saved.kv_transfers[0]["bytes"] and load["block_ids"] and len(load["block_ids"]) == 2
