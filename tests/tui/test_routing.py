"""A mixture of experts' routing in the TUI, and as a breakpoint: the Step panel's layer × expert
heat map equals the routing events' counts (sparse layers only), names the busiest and the idle
experts, and lists the selected request's experts with their weights; `expert:L:E` holds the
engine in the first step in which that expert receives tokens."""
from __future__ import annotations

import threading

import pytest

from engine import LLM, Hooks, SamplingParams
from engine.trace_names import MODEL_RUNNER, ROUTING
from tests.engine.test_moe import _hf_model, _save
from tests.tui.helpers import shown
from tracer.conditions import parse_condition
from tracer.remote_controller import _unwire, _wire
from tracer.replay import Replay
from tracer.session import TraceSession
from tracer.tui.app import TraceApp
from tracer.tui.sources.replay import ReplaySource
from tracer.tui.widgets.routing import layer_summary

PROMPTS = [list(range(10, 30)), list(range(40, 47))]
PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
T = 60  # seconds; only reached if something is broken


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    return _save(tmp_path_factory.mktemp("qwen3_moe"), _hf_model("qwen3_moe"), fused=False)


@pytest.fixture(scope="module")
def moe_trace(qwen3_moe, tmp_path_factory):
    path = tmp_path_factory.mktemp("moe-trace") / "trace.jsonl"
    hooks = Hooks()
    session = TraceSession(hooks, trace_file=path, control=False, model=qwen3_moe)
    # synchronous: replay at step k shows step k's routing and batch together
    llm = LLM(qwen3_moe, dtype="float32", hooks=hooks, async_scheduling=False)
    llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    llm.shutdown()
    session.close()
    return path


def routing_by_step(replay: Replay) -> dict[int, dict[int, dict]]:
    out: dict[int, dict[int, dict]] = {}
    for e in replay.events:
        if (e.layer, e.name) == (MODEL_RUNNER, ROUTING):
            out.setdefault(e.step, {})[e.attrs["layer_idx"]] = e.attrs
    return out


@pytest.mark.slow
@pytest.mark.asyncio
async def test_the_step_panel_draws_the_routing_heat_map_and_a_requests_experts(moe_trace):
    source = ReplaySource.load(moe_trace)
    routing = routing_by_step(source.replay)
    step = sorted(routing)[0]  # the prefill: 27 tokens routed in each sparse layer
    source.replay.goto(step)
    app = TraceApp(source, initial_pane="step")
    async with app.run_test(size=(160, 60)) as pilot:
        app.tick()
        await pilot.pause()
        text = shown(app.query_one("#routing-lines"))
        assert f"mixture of experts: routing in step {step}" in text and "8 experts, top-2" in text
        lines = {line.split()[0]: line for line in text.splitlines() if line.startswith("L")}
        assert sorted(lines) == ["L0", "L2"]  # layer 1 is dense (mlp_only_layers): nothing routed there
        for layer, a in routing[step].items():
            cells = lines[f"L{layer}"].split("busiest")[0].split()[1:]
            assert cells == [str(n) if n else "·" for n in a["expert_counts"]]
            assert layer_summary(a["expert_counts"]) in lines[f"L{layer}"]
        counts = routing[step][0]["expert_counts"]
        assert f"busiest {counts.index(max(counts))} ({max(counts)})" in lines["L0"]
        # the first request in the batch, token 0: its two experts, best first, with their weights, per layer
        rid = next(iter(routing[step][0]["topk_ids"]))
        assert f"experts of request {rid}" in text
        token0 = next(line for line in text.splitlines() if line.strip().startswith("token 0"))
        for layer in (0, 2):
            ids, weights = routing[step][layer]["topk_ids"][rid][0], routing[step][layer]["topk_weights"][rid][0]
            assert f"L{layer} " + " ".join(f"{e}·{w:.2f}" for e, w in zip(ids, weights)) in token0


def test_summary_names_the_busiest_the_idle_and_the_imbalance():
    assert layer_summary([3, 0, 1, 0]) == "busiest 0 (3) · idle 1 3 · imbalance 3.0×"
    assert layer_summary([2, 2]) == "busiest 0 (2) · none idle · imbalance 1.0×"


def test_expert_conditions_parse_travel_and_match_only_a_step_that_routes_to_the_expert():
    cond = parse_condition("expert:2:5")
    assert str(cond) == "expert:2:5" and _unwire(_wire(cond)) == cond
    routed = {"layer_idx": 2, "expert_counts": [1, 0, 0, 0, 0, 3, 0, 0]}
    assert cond.matches(MODEL_RUNNER, ROUTING, None, routed)
    assert not cond.matches(MODEL_RUNNER, ROUTING, None, routed | {"layer_idx": 0})
    assert not cond.matches(MODEL_RUNNER, ROUTING, None, routed | {"expert_counts": [1] * 5 + [0, 0, 0]})
    for bad in ("expert:2", "expert:a:1", "expert:1:"):
        with pytest.raises(ValueError, match="expert:LAYER:EXPERT"):
            parse_condition(bad)


@pytest.mark.slow
def test_an_expert_breakpoint_holds_the_first_step_that_expert_receives_tokens(qwen3_moe):
    prompts, params = [{"prompt_token_ids": [10, 11]}], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    hooks, events = Hooks(), []
    hooks.subscribe(lambda *e: events.append(e), lambda evs, at_ns=None: events.extend(evs))
    llm = LLM(qwen3_moe, dtype="float32", hooks=hooks, async_scheduling=False)
    llm.generate(prompts, params, use_tqdm=False)
    llm.shutdown()
    counts = {(step, a["layer_idx"]): a["expert_counts"] for layer, name, _, _, step, a in events
              if (layer, name) == (MODEL_RUNNER, ROUTING)}
    # an expert the two-token prefill (step 0) leaves idle and a later step uses: the same greedy run again
    step, layer, expert = min((s, layer, e) for (s, layer), c in counts.items() if s
                              for e, n in enumerate(c) if n and not counts[0, layer][e])
    hooks = Hooks()
    session = TraceSession(hooks, start_paused=False)
    llm = LLM(qwen3_moe, dtype="float32", hooks=hooks, async_scheduling=False)
    session.controller.add_breakpoint(parse_condition(f"expert:{layer}:{expert}"))
    run = threading.Thread(target=llm.generate, args=(prompts, params), kwargs=dict(use_tqdm=False), daemon=True)
    run.start()
    try:
        stop = session.controller.wait_until_paused(T)
        assert stop.reason == f"breakpoint expert:{layer}:{expert}" and stop.step == step
        view = session.state.view()
        assert view.routing_step == step and view.routing[layer]["expert_counts"][expert] > 0
        session.controller.clear_breakpoints()
        session.controller.resume()
        run.join(T)
        assert not run.is_alive()
    finally:
        session.close()
        llm.shutdown()


@pytest.mark.asyncio
async def test_the_heat_map_numbers_its_experts_when_its_panel_opens(moe_trace):
    """Drawn while its panel was hidden, the view had no size of its own; opened, it still draws
    numbered expert columns (not the bars of a screen too narrow for them)."""
    source = ReplaySource.load(moe_trace)
    source.replay.goto(sorted(routing_by_step(source.replay))[0])
    app = TraceApp(source, initial_pane="overview")
    async with app.run_test(size=(160, 60)) as pilot:
        app.tick()
        await pilot.pause()
        await pilot.press("4")
        app.tick()
        await pilot.pause()
        head = next(line for line in shown(app.query_one("#routing-lines")).splitlines() if line.startswith("expert"))
        assert head.split() == ["expert", *map(str, range(8))]
