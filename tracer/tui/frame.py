"""What every panel is given on each refresh: one consistent picture of the engine."""
from __future__ import annotations

from dataclasses import dataclass, field

from tracer.state import TraceState
from tracer.tui.fmt import color_map


@dataclass
class Frame:
    state: TraceState
    controller: dict  # the step controller's status
    now_ns: int  # trace time now (for ages)
    selected: str | None = None  # the request chosen in the Requests panel (highlighted everywhere)
    colors: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, state: TraceState, controller: dict, now_ns: int, selected: str | None) -> "Frame":
        return cls(state, controller, now_ns, selected, color_map(state.requests))

    def color(self, request_id: str) -> str:
        return self.colors.get(request_id, "white")

    def age(self, request_id: str) -> int | None:
        """How long it has been in the engine (until its finish, once finished)."""
        r = self.state.requests.get(request_id)
        if r is None or r.arrival_ns is None:
            return None
        return (r.finished_ns if r.finished_ns is not None else self.now_ns) - r.arrival_ns
