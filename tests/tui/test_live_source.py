"""The TUI folds the session's own state (what /trace/state answers from): one fold of every
event, not two, and the session's follower thread rests while the TUI does its work."""
import asyncio

from engine.hooks import Hooks
from engine.trace_names import API
from tracer.session import TraceSession
from tracer.tui.sources.base import SourceInfo
from tracer.tui.sources.live import LiveSource


def test_the_tui_folds_the_sessions_state_and_the_follower_rests_meanwhile():
    hooks = Hooks()
    session = TraceSession(hooks, control=False, model="tiny-gpt2-random")
    try:
        session.state.follow()
        source = LiveSource(session, SourceInfo("live", "tiny-gpt2-random", "cpu", "torch"))
        assert not session.state.following  # nobody else mutates the state the panels read
        before = session.state.state.num_events
        for i in range(5):
            hooks.emit(API, "sse_chunk", request_id=f"r{i}", text="x")
        state = source.refresh()
        assert state is session.state.state and state.num_events == before + 5
        assert [e.request_id for e in source.take_events().events][-5:] == [f"r{i}" for i in range(5)]
        assert session.state.view().num_events == before + 5  # /trace/state: the same fold, nothing pending
        asyncio.run(source.close())
        assert session.state.following  # the TUI has gone: the follower keeps the state current again
    finally:
        session.state.stop_following()
        session.close()
