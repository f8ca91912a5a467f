"""ReplaySource: a recorded trace (`vllm-trace replay FILE`), with time travel.

The position moves a step at a time (←/→), or to the first/last step (home/end). The state
is tracer.replay.Replay's, i.e. the same fold the live engine's viewers use. The Log shows the
events up to the position; going back rewinds it.
"""
from __future__ import annotations

import asyncio
from pathlib import Path

from engine.trace_names import CONFIG, ENGINE
from tracer.replay import Replay
from tracer.state import TraceState
from tracer.tui.sources.base import EventBatch, Source, SourceInfo, Unsupported, engine_identity

LOG_TAIL = 400  # events re-sent to the Log after a jump


class ReplaySource(Source):
    can_control = False
    can_time_travel = True

    def __init__(self, replay: Replay, path: str | Path = "trace"):
        self.replay = replay
        self.path = str(path)
        # the engine's own config event is the authority (a header may carry none)
        cfg = next((ev.attrs.get("config") for ev in replay.events[:50]
                    if ev.layer == ENGINE and ev.name == CONFIG and ev.attrs), None)
        cfg = cfg or replay.header.get("engine_config") or {}
        model_cfg = cfg.get("model") or {}
        startup = Replay(replay.header, replay.events[:200]).final()  # the startup stages
        startup.engine_config = startup.engine_config or cfg
        device, backend = engine_identity(startup)
        self.info = SourceInfo("replay", model=replay.header.get("model") or model_cfg.get("model") or "?",
                               device=device, backend=backend, url=Path(self.path).name)
        self._logged = 0  # events the Log has been given
        self._reset = False
        # open at the first step, so the first thing a user sees is a step, and → moves on
        if replay.steps:
            replay.goto(replay.steps[0])
        else:
            replay.final()

    @classmethod
    def load(cls, path: str | Path) -> "ReplaySource":
        return cls(Replay.load(path), path)

    def refresh(self) -> TraceState:
        return self.replay.state

    def take_events(self) -> EventBatch:
        pos = self.replay.position
        if self._reset or pos < self._logged:
            start, reset = max(0, pos - LOG_TAIL), True
        else:
            start, reset = max(self._logged, pos - LOG_TAIL), False
        self._logged, self._reset = pos, False
        return EventBatch(self.replay.events[start:pos], reset=reset)

    def now_ns(self) -> int:
        return self.replay.state.last_ts_ns

    def in_flight(self) -> int:
        return 0  # nothing runs: quitting a replay loses nothing

    def controller(self) -> dict:
        r = self.replay
        return {"paused": True, "replay": True, "position": r.position, "num_events": len(r.events),
                "first_step": r.steps[0] if r.steps else None, "last_step": r.steps[-1] if r.steps else None,
                "breakpoints": []}

    async def travel(self, where: str) -> None:
        r = self.replay
        if where == "back":
            before = r.step
            r.prev()
            if before is not None and r.step == before:  # at `end`, past the last step's end: one more
                r.prev()
        elif where == "forward":
            r.next()
        elif where == "home":
            r.goto(r.steps[0]) if r.steps else r.seek(0)
        elif where == "end":
            r.final()
        else:
            raise ValueError(f"unknown direction {where!r}")

    async def export(self, path: str) -> str:
        from tracer.export import export_perfetto
        result = await asyncio.to_thread(export_perfetto, self.path, path)  # a big trace takes seconds
        cut = " (the recording is truncated: its torn last line left out)" if result.truncated else ""
        return f"{result.num_events} Perfetto events to {path}{cut} (open in ui.perfetto.dev)"

    async def send_test_request(self, prompt: str, max_tokens: int = 16) -> str:
        raise Unsupported("a replay cannot take requests; `vllm-trace serve` can")
