"""One request's journey through the layers, read from a trace.

Most events name their request; step-level events (the model runner's batch, the sampler, a
kernel launch, the schedule span) belong to every request scheduled in that step.
"""
from __future__ import annotations

from engine.trace_names import (
    API,
    BLOCK_MANAGER,
    DETOKENIZER,
    ENGINE,
    HTTP,
    IPC,
    KERNEL,
    MODEL_RUNNER,
    SAMPLER,
    SCHEDULE,
    SCHEDULER,
    TOKENIZER,
    TRACER,
)
from tracer.events import Event

# The order a request meets the layers, outermost to innermost and back out.
CHAIN = (HTTP, API, TOKENIZER, ENGINE, SCHEDULER, BLOCK_MANAGER, MODEL_RUNNER, KERNEL, SAMPLER, DETOKENIZER, HTTP)
# With the engine core in its own process, the request crosses the boundary (ipc) on its way in.
TWO_PROCESS_CHAIN = (HTTP, API, TOKENIZER, IPC, *CHAIN[3:])


def scheduled_in_steps(events: list[Event]) -> dict[int, set[str]]:
    """step -> the request ids the schedule snapshot of that step scheduled."""
    out: dict[int, set[str]] = {}
    for ev in events:
        if ev.layer == SCHEDULER and ev.name == SCHEDULE and ev.kind == "snapshot" and ev.step is not None:
            out[ev.step] = {s["request_id"] for s in (ev.attrs or {}).get("scheduled", [])}
    return out


def request_events(events: list[Event], request_id: str) -> list[Event]:
    """The request's own events and the step-level events of the steps it was scheduled in."""
    steps = {s for s, ids in scheduled_in_steps(events).items() if request_id in ids}
    return [ev for ev in events if ev.request_id == request_id
            or (ev.request_id is None and ev.step in steps and ev.layer not in (ENGINE, TRACER))]


def layer_path(events: list[Event]) -> list[str]:
    """The layers in the order first met, with the final layer appended when the request
    leaves through a layer it already passed (the HTTP response)."""
    seen: list[str] = []
    for ev in events:
        if ev.layer not in seen:
            seen.append(ev.layer)
    if events and events[-1].layer != seen[-1]:
        seen.append(events[-1].layer)
    return seen


def missing_links(path: list[str], chain: tuple[str, ...] = CHAIN) -> list[str]:
    """What breaks `chain` in `path`: layers absent or met out of order (empty if none)."""
    problems, pos = [], 0
    for layer in chain:
        try:
            pos = path.index(layer, pos) + 1
        except ValueError:
            problems.append(f"{layer} missing or out of order after {path[:pos]}")
    return problems
