"""One call to wire the tracer to an engine's hooks (for the server, the TUI and lessons).

    hooks = Hooks()
    with TraceSession(hooks, trace_file="run.jsonl", start_paused=True) as tracing:
        llm = LLM("tiny-gpt2", hooks=hooks)     # startup stages are traced too
        ...                                       # tracing.controller.step(), tracing.state.view()

Create the session before the engine, so the engine's startup is in the trace. With the
engine core in another process (``engine.engine.async_llm.AsyncLLM``), pass ``remote_control=True``
and give the engine ``session.core_options()``; once it is launched, ``session.bind(async_llm)``.
"""
from __future__ import annotations

import atexit
from pathlib import Path
from typing import Iterable, TextIO

from engine.hooks import Hooks
from tracer.bus import DEFAULT_CAPACITY, EventBus
from tracer.controller import StepController
from tracer.recorder import Recorder
from tracer.remote_controller import CORE_INSTALL, RemoteStepController
from tracer.state import LiveState
from tracer.tracelog import TraceLog


class TraceSession:
    def __init__(self, hooks: Hooks, trace_file: str | Path | None = None, trace_log: TextIO | bool | None = None,
                 layers: Iterable[str] | None = None, start_paused: bool = False, control: bool = True,
                 model: str | None = None, engine_config: dict | None = None, capacity: int = DEFAULT_CAPACITY,
                 start_ns: int | None = None, remote_control: bool = False):
        """trace_file: record JSON lines there. trace_log: print [TRACE] lines (True: to stderr,
        or a stream), only `layers` if given. control: attach a StepController (`start_paused`
        holds the engine before its first step). start_ns: a time.perf_counter_ns() reading the
        trace's clock starts from (default now; see EventBus). remote_control: the engine
        core runs in another process; the controller is a RemoteStepController."""
        self.hooks = hooks
        self.bus = EventBus(capacity, start_ns=start_ns)
        self._detach = self.bus.attach(hooks)
        self.state = LiveState(self.bus)
        self.recorder = Recorder(self.bus, trace_file, model, engine_config) if trace_file else None
        self.trace_log = None
        if trace_log:
            self.trace_log = TraceLog(self.bus, None if trace_log is True else trace_log, layers)
        self.controller = None
        if control or start_paused:
            self.controller = (RemoteStepController(hooks, start_paused) if remote_control
                               else StepController(hooks, start_paused))
        self._closed = False
        atexit.register(self.close)  # Ctrl-C or exit without close(): the trace file is still complete

    def core_options(self) -> dict:
        """What an engine core in another process needs to be traced and controlled like this."""
        return {"trace": True, "control": self.controller is not None, "install": CORE_INSTALL,
                "start_paused": getattr(self.controller, "start_paused", False)}

    def bind(self, async_llm) -> None:
        """Connect a RemoteStepController to a launched AsyncLLM's core."""
        if isinstance(self.controller, RemoteStepController):
            self.controller.bind(async_llm.engine_core)

    def close(self) -> None:
        """Let the engine run free, stop listening, finish the trace file. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        if self.controller is not None:
            self.controller.close()
        self._detach()
        for sink in (self.recorder, self.trace_log):
            if sink is not None:
                sink.close()
        self.bus.close()

    def __enter__(self) -> "TraceSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
