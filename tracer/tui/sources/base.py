"""The Source interface the app drives.

Reads (``refresh``, ``state``, ``take_events``, ``now_ns``) are called on the UI thread at the
refresh rate and must never wait on the engine. Commands are coroutines: a live source
answers at once (the controller only flips flags), a remote one awaits HTTP.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from tracer.events import Event
from tracer.state import TraceState


class Unsupported(Exception):
    """The command makes no sense for this source (stepping a replay's engine, ...)."""


@dataclass
class SourceInfo:
    mode: str  # "live", "attach" or "replay"
    model: str = "?"
    device: str = "?"
    backend: str = "?"
    url: str | None = None  # where to send requests (live, attach) or the trace file (replay)


def engine_identity(state: TraceState, fallback: tuple[str, str] = ("?", "?")) -> tuple[str, str]:
    """(device, attention backend) the engine really uses, from its startup stages (the config
    may say None or auto); `fallback` while they have not been seen."""
    device, backend = fallback
    cfg = state.engine_config or {}
    device = (cfg.get("model") or {}).get("device") or device
    backend = cfg.get("attention_backend") or backend
    for st in state.startup:
        if st["stage"] == "model_load":
            device, backend = st.get("device", device), st.get("attention_backend", backend)
        elif st["stage"] == "kernel_warmup" and st.get("backend"):
            backend = st["backend"]
    return device, backend


@dataclass
class EventBatch:
    events: list[Event] = field(default_factory=list)
    missed: int = 0  # events the log never saw (a slow reader fell a whole ring behind)
    reset: bool = False  # the log must start over (a replay jumped backward)


class LogBuffer:
    """Events that arrived since the Log panel last took them (live and attach sources).
    Bounded: a log panel that is not looking keeps only the newest `backlog` events."""

    def __init__(self, backlog: int = 5000):
        self.events: deque[Event] = deque(maxlen=backlog)
        self.missed = 0

    def take(self) -> EventBatch:
        batch = EventBatch(list(self.events), self.missed)
        self.events.clear()
        self.missed = 0
        return batch


class Source:
    info: SourceInfo
    can_control = True  # pause / step / breakpoints
    can_time_travel = False  # replay: back, forward, home, end

    async def start(self) -> None:
        """Connect and take the first state (an attach fails here if nobody answers)."""

    async def close(self) -> None:
        pass

    def refresh(self) -> TraceState:
        """Fold what arrived since the last call; returns the current state (do not mutate)."""
        raise NotImplementedError

    def take_events(self) -> EventBatch:
        """The events since the last call, for the Log panel."""
        raise NotImplementedError

    def now_ns(self) -> int:
        """Trace time now (ns since the trace started), for ages."""
        raise NotImplementedError

    def controller(self) -> dict:
        """The step controller's status (paused, point, reason, breakpoints, ...)."""
        return {"paused": False, "breakpoints": []}

    def in_flight(self) -> int:
        state = self.refresh()
        return len(state.waiting) + len(state.running)

    def disconnected(self) -> str | None:
        """Why the source has lost its engine (attach: the server went away), else None."""
        return None

    def kernel_access(self, kernel: dict, state: TraceState) -> dict | None:
        """pid -> ProgramAccess tuple for a kernel launch of the current step, or None when the
        launch has no program grid (a PyTorch reference) to map."""
        from tracer.tui.access import access_map
        return access_map(kernel, state)

    # ---- commands ------------------------------------------------------------------------
    async def pause(self) -> None:
        raise Unsupported("this source has no engine to pause")

    async def resume(self) -> None:
        raise Unsupported("this source has no engine to resume")

    async def step(self, n: int = 1, granularity: str = "step") -> None:
        raise Unsupported("this source has no engine to step")

    async def add_breakpoint(self, condition: str) -> None:
        raise Unsupported("breakpoints need a running engine")

    async def remove_breakpoint(self, condition: str) -> None:
        raise Unsupported("breakpoints need a running engine")

    async def start_profile(self) -> None:
        """`p`: every op of the forward pass a launch from the next step on (POST /start_profile)."""
        raise Unsupported("profiling needs a running engine (vllm-trace serve, or attach to one)")

    async def stop_profile(self) -> None:
        """`p` again: back to the usual launches (POST /stop_profile)."""
        raise Unsupported("profiling needs a running engine (vllm-trace serve, or attach to one)")

    async def send_test_request(self, prompt: str, max_tokens: int = 16) -> str:
        """A greedy completion of prompt (temperature 0, as `vllm-trace send`); returns where it went."""
        raise Unsupported("no server to send a request to")

    async def export(self, path: str) -> str:
        """Write the trace so far to path (JSON lines, the --trace-file format); returns what was written."""
        raise Unsupported("nothing to export")

    async def held_attention_on_triton(self) -> dict:
        """`t`: the attention launch the engine is held before, run through the Triton kernel
        (kernels.rerun's plain data: grid, programs, max |diff| against PyTorch)."""
        raise Unsupported("re-running a launch needs the engine (vllm-trace serve)")

    async def travel(self, where: str) -> None:
        """Replay: "back", "forward", "home" or "end"."""
        raise Unsupported("time travel needs a recorded trace (vllm-trace replay FILE)")
