"""A hybrid KV cache in the TUI: a Ministral-shaped checkpoint (sliding-window and full-attention layers
alternating: two KV-cache groups over one block pool). The request detail shows each group's table with
the null block (∅) where the window has passed, exactly the engine's tables; the KV grid draws every
group's blocks; the Startup and KV-cache panels name the groups and how many requests of max_model_len
fit against full attention everywhere, the engine's own figures."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, Hooks, SamplingParams
from engine.builtin_model import write_byte_tokenizer
from tests.tui.helpers import shown
from tracer.session import TraceSession
from tracer.state import hybrid_cache
from tracer.tui.app import TraceApp
from tracer.tui.frame import Frame
from tracer.tui.sources.replay import ReplaySource
from tracer.tui.widgets.header import StatusHeader
from tracer.tui.widgets.kv_cache import block_owners
from tracer.tui.widgets.request_detail import group_tables

WINDOW, BLOCK = 12, 4


@pytest.fixture(scope="module")
def ministral(tmp_path_factory):
    from transformers import MinistralConfig, MinistralForCausalLM

    torch.manual_seed(1)
    cfg = MinistralConfig(vocab_size=257, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                          num_attention_heads=8, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
                          bos_token_id=256, eos_token_id=256, sliding_window=WINDOW, tie_word_embeddings=False,
                          layer_types=["sliding_attention", "full_attention"] * 2)
    path = tmp_path_factory.mktemp("ministral")
    MinistralForCausalLM(cfg).save_pretrained(path)
    write_byte_tokenizer(path, 256)
    return str(path)


@pytest.fixture(scope="module")
def held_long_request(ministral, tmp_path_factory):
    """A 37-token prompt 10 tokens into its generation, the engine stopped there; the trace recorded."""
    trace = tmp_path_factory.mktemp("hybrid") / "trace.jsonl"
    hooks = Hooks()
    session = TraceSession(hooks, trace_file=trace, control=False, model=ministral)
    llm = LLM(ministral, hooks=hooks, block_size=BLOCK, num_kv_blocks=64, max_model_len=64, async_scheduling=False)
    engine = llm.llm_engine
    engine.add_request("long", "a sliding window forgets the far past", SamplingParams(max_tokens=20, temperature=0,
                                                                                         ignore_eos=True))
    for _ in range(11):  # the prefill, then 10 decode steps
        engine.step()
    core_request = engine.engine_core.engine_core.scheduler.requests["long"]
    tables = [list(t) for t in core_request.kv_block_ids]
    session.state.update()
    state = session.state.view()
    session.close()
    yield state, tables, trace
    llm.shutdown()


def test_each_groups_table_is_the_engines_with_the_null_block_where_the_window_passed(held_long_request):
    state, tables, _ = held_long_request
    r = state.requests["long"]
    assert r.kv_block_tables == tables and len(tables) == 2
    sliding = tables[0]
    assert sliding.count(0) >= 3 and all(tables[1])  # the window passed the first blocks; full attention keeps all
    assert sum(1 for b in sliding if b) <= -(-(WINDOW - 1) // BLOCK) + 1  # the window's blocks only
    text = group_tables(Frame.of(state, {}, 0, None), r).plain
    assert "group 0 sliding window 12, layers 0 2:" in text and "group 1 full attention, layers 1 3:" in text
    assert "0→∅" in text and f"({sliding.count(0)} passed by the window: back in the pool)" in text
    owners = block_owners(Frame.of(state, {}, 0, None))
    assert set(owners) == {b for t in tables for b in t if b}  # every group's blocks, never the null block


@pytest.mark.slow
@pytest.mark.asyncio
async def test_startup_and_kv_panels_name_the_groups_and_what_fits(held_long_request):
    state, _, trace = held_long_request
    h = hybrid_cache(state)
    assert [g["sliding_window"] for g in h["kv_cache_groups"]] == [WINDOW, None]
    assert h["requests_at_max_len"] > h["requests_at_max_len_full_attention"]
    says = (f"2 KV-cache groups: sliding window 12 (layers 0 2), full attention (layers 1 3); "
            f"{h['requests_at_max_len']} requests of max_model_len fit at once ({h['blocks_per_request']} blocks "
            f"each), {h['requests_at_max_len_full_attention']} with full attention on every layer")
    source = ReplaySource.load(trace)
    source.replay.goto(source.replay.steps[-1])
    app = TraceApp(source, initial_pane="kv")
    async with app.run_test(size=(200, 50)) as pilot:
        app.tick()
        await pilot.pause()
        assert says.split(";")[0] in " ".join(shown(app.query_one("#kv-summary")).split())
        await pilot.press("7")
        app.tick()
        await pilot.pause()
        assert says in " ".join(shown(app.query_one("#startup-stages")).split())
        more = h["requests_at_max_len"] - h["requests_at_max_len_full_attention"]
        assert (f"hybrid KV: {h['requests_at_max_len']} requests fit, {more} more than with full attention"
                in shown(app.query_one(StatusHeader)))
