"""The trace API: the tracer's state, event stream and step controller over HTTP.

    GET    /trace/state                 {"state", "controller", "step", "seq"}
    GET    /trace/events                server-sent events (?layer=a,b&request_id=X&since=SEQ)
    POST   /trace/pause | /trace/resume {"controller"}
    POST   /trace/step                  {"n", "granularity", "wait", "timeout"} -> {"controller", "stop"}
                                        (with wait: "timed_out", and "idle" when no request could step)
    POST   /trace/run_until             {"condition"} -> {"controller"}
    DELETE /trace/run_until             disarm a pending run_until -> {"controller"}
    GET    /trace/breakpoints           {"breakpoints": [...]}
    POST   /trace/breakpoints           {"condition"} -> the breakpoint (201)
    DELETE /trace/breakpoints/{id}      204

Mounted by `vllm-trace serve` on the OpenAI app: ``app.state.trace = session`` (a
``TraceSession``, or None when tracing is off: every route then answers 503) and
``app.include_router(router)``. It lives in the tracer, not in engine.server, because the
engine must not depend on the tracer (design notes: kernels <- engine <- tracer).

Reading (state, events, the breakpoint list) shows every user's prompts and outputs, so it
goes through ``require_trace_read`` (the API key, or loopback-only without one); changing the
engine's course through ``require_control`` (the same, and a POST must be JSON: see
engine.entrypoints.openai.security).
"""
from __future__ import annotations

import asyncio
import json
import time
from typing import Annotated, AsyncIterator, Literal

from fastapi import APIRouter, Depends, FastAPI, Path, Query, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from engine.entrypoints.openai.errors import ERROR_RESPONSES, APIError
from engine.entrypoints.openai.protocol import ErrorResponse, Text
from engine.entrypoints.openai.security import require_control, require_trace_read
from engine.trace_names import ENGINE, SCHEDULE, SCHEDULER, TRACER
from tracer.bus import Subscription
from tracer.conditions import Condition, parse_condition
from tracer.controller import StepController
from tracer.events import LAYERS, Event
from tracer.session import TraceSession

POLL_INTERVAL = 0.05  # s: the event stream polls the bus, so the engine never pays for wake-ups
KEEP_ALIVE = 15.0  # s: a comment line keeps proxies from closing an idle stream
MAX_BATCH = 1024  # events per pull; a slow client is told what it missed rather than slowing anyone
STEP_WAIT_TIMEOUT = 10.0  # s: default for POST /trace/step with wait
IDLE_WAIT = 2.0  # s: a step with wait on an engine with no request answers (idle) after this, not its timeout
IDLE_DETAIL = ("the engine is idle: no request is waiting or running, so no step runs to stop at. The step "
               "stays armed: send a request and the engine holds at its step")
# Every integer this API takes is bounded, so none reaches the controller, msgpack (the core's
# controller is across a socket: it refuses integers past 64 bits with a 500) or a JSON encoder
# unchecked. A billion control points is more than any session steps through; resume runs freely.
MAX_STEP_N = 10 ** 9
MAX_ID = 2 ** 63 - 1  # event sequence numbers and breakpoint ids

router = APIRouter(prefix="/trace", tags=["trace"], dependencies=[Depends(require_trace_read)],
                   responses=ERROR_RESPONSES | {403: {"model": ErrorResponse}, 503: {"model": ErrorResponse}})
control = [Depends(require_control)]
JSON_ONLY = {415: {"model": ErrorResponse, "description": "a web page's POST whose body is not declared as JSON"}}


# ---- dependencies ---------------------------------------------------------------------------
async def get_session(request: Request) -> TraceSession:
    session = getattr(request.app.state, "trace", None)
    if session is None:
        raise APIError(503, "tracing is off on this server (started with --no-trace); restart without it "
                            "to use /trace", code="tracing_disabled")
    return session


async def get_controller(session: Annotated[TraceSession, Depends(get_session)]) -> StepController:
    if session.controller is None:
        raise APIError(503, "this trace session has no step controller", code="control_unavailable")
    return session.controller


def _closed_error() -> APIError:
    return APIError(503, "the server is shutting down: the step controller has let the engine run, to drain the "
                         "requests in flight", code="controller_closed")


async def get_open_controller(controller: Annotated[StepController, Depends(get_controller)]) -> StepController:
    """The controller, for a command that would hold the engine: refused once the server drains."""
    if controller.closed:
        raise _closed_error()
    return controller


SessionDep = Annotated[TraceSession, Depends(get_session)]
ControllerDep = Annotated[StepController, Depends(get_controller)]
OpenControllerDep = Annotated[StepController, Depends(get_open_controller)]


def _status(controller: StepController | None) -> dict | None:
    return None if controller is None else controller.status()


def _stop_dict(stop) -> dict | None:
    return None if stop is None else {"point": stop.point, "step": stop.step, "reason": stop.reason}


# ---- state ----------------------------------------------------------------------------------
@router.get("/state", response_class=Response,
            responses={200: {"content": {"application/json": {"schema": {"type": "object"}}},
                             "description": '{"state", "controller", "step", "seq"}'}})
async def trace_state(session: SessionDep, request: Request) -> Response:
    """The engine as the tracer sees it now (folded from every event so far; the latest
    finished requests only: see serve --trace-max-finished)."""
    t = time.perf_counter()
    view = session.state.view()
    body = view.to_json(controller=_status(session.controller),
                        step=request.app.state.server.engine.step_count, seq=session.bus.next_seq)
    # how long the fold's catch-up, the copy and the JSON took (a browser's devtools show it)
    timing = {"Server-Timing": f"state;dur={(time.perf_counter() - t) * 1000:.1f}"}
    return Response(body, media_type="application/json", headers=timing)


# ---- the event stream -----------------------------------------------------------------------
class _Filter:
    """Which events a stream sends. With a request id: that request's own events, plus the
    step-level ones (batch, kernels, sampler) of the steps it was scheduled in, as
    tracer.journey counts them; the schedule snapshot that names it opens such a step."""

    def __init__(self, layers: frozenset[str] | None, request_id: str | None):
        self.layers, self.request_id = layers, request_id
        self._step: int | None = None  # the latest step that scheduled request_id

    def __call__(self, ev: Event) -> bool:
        if self.request_id is not None:
            if ev.layer == SCHEDULER and ev.name == SCHEDULE and ev.kind == "snapshot":
                if any(s["request_id"] == self.request_id for s in (ev.attrs or {}).get("scheduled", ())):
                    self._step = ev.step
                    return self.layers is None or ev.layer in self.layers
            if ev.request_id != self.request_id and not (
                    ev.request_id is None and ev.step is not None and ev.step == self._step
                    and ev.layer not in (ENGINE, TRACER)):
                return False
        return self.layers is None or ev.layer in self.layers


def _parse_layers(layer: str | None) -> frozenset[str] | None:
    if not layer:
        return None
    layers = frozenset(x.strip() for x in layer.split(",") if x.strip())
    unknown = layers - set(LAYERS)
    if unknown:
        raise APIError(400, f"unknown layer(s) {', '.join(sorted(unknown))}; layers are {', '.join(LAYERS)}",
                       param="layer")
    return layers


def stop_event_streams(app: FastAPI) -> None:
    """End every open /trace/events stream (the server is shutting down: don't make it wait)."""
    app.state.trace_streams_closed = True


async def _event_stream(request: Request, session: TraceSession, sub: Subscription,
                        keep: _Filter) -> AsyncIterator[str]:
    last_sent = time.monotonic()
    app_state = request.app.state
    while True:
        closing = session.bus.closed or getattr(app_state, "trace_streams_closed", False)
        if closing and not sub.pending:
            return  # what was published before the end has been sent
        pulled = sub.pull(max_events=MAX_BATCH)
        out = []
        if pulled.missed:
            out.append(f"event: missed\ndata: {json.dumps({'count': pulled.missed})}\n\n")
        out += [f"data: {ev.to_json()}\n\n" for ev in pulled.events if keep(ev)]
        if out:
            last_sent = time.monotonic()
            yield "".join(out)
        elif time.monotonic() - last_sent >= KEEP_ALIVE:
            last_sent = time.monotonic()
            yield ": keep-alive\n\n"
        if len(pulled.events) < MAX_BATCH and not closing:  # caught up: wait (a full batch means more is there)
            await asyncio.sleep(POLL_INTERVAL)


@router.get("/events", response_class=StreamingResponse,
            responses={200: {"content": {"text/event-stream": {}},
                             "description": "`data: <event JSON>` per event; `event: missed` with a count "
                                            "when this client fell a whole ring behind"}})
async def trace_events(session: SessionDep, request: Request,
                       layer: Annotated[str | None, Query(description="comma-separated layers")] = None,
                       request_id: Annotated[str | None, Query(description="one request's journey")] = None,
                       since: Annotated[int | None, Query(ge=0, le=MAX_ID, description="first seq to send "
                                                          "(default: live from now)")] = None):
    """The tracer's event stream as server-sent events. Ends when the client disconnects or
    the server shuts down."""
    keep = _Filter(_parse_layers(layer), request_id)
    sub = session.bus.subscribe() if since is None else Subscription(session.bus, min(since, session.bus.next_seq))
    return StreamingResponse(_event_stream(request, session, sub, keep), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


# ---- step control ---------------------------------------------------------------------------
class EmptyBody(BaseModel):
    """Pause and resume take no parameters, but their POST must be JSON (``{}``): see
    engine.entrypoints.openai.security.require_control."""
    model_config = ConfigDict(extra="allow")


class StepBody(BaseModel):
    n: int = Field(1, ge=1, le=MAX_STEP_N, description="how many control points of this granularity to run")
    granularity: Literal["step", "phase", "kernel"] = Field(
        "step", description="step: one engine step (step over); phase: schedule/execute_model/grammar "
                            "bitmask/sample_tokens/update_from_output (step into); kernel: the next kernel launch")
    wait: bool = Field(False, description="answer once the engine is held again (or the timeout passed)")
    timeout: float = Field(STEP_WAIT_TIMEOUT, gt=0, le=300, description="seconds to wait, with wait")


class Breakpoint(BaseModel):
    id: int
    condition: str
    layer: str | None
    name: str | None
    request_id: str | None


class ConditionBody(BaseModel):
    condition: Text = Field(description="arrive[:ID], finish[:ID], preempt[:ID], request:ID, layer:LAYER, "
                                        "kernel:NAME, event:LAYER.NAME or expert:LAYER:EXPERT",
                            examples=["finish"])


def _condition(text: str) -> Condition:
    try:
        return parse_condition(text)
    except ValueError as e:
        raise APIError(400, str(e), param="condition") from None


@router.post("/pause", dependencies=control, responses=JSON_ONLY)
async def pause(controller: OpenControllerDep, body: EmptyBody | None = None) -> dict:
    """Hold the engine at its next step boundary (new requests still arrive and wait)."""
    controller.pause()
    return {"controller": controller.status()}


@router.post("/resume", dependencies=control, responses=JSON_ONLY)
async def resume(controller: ControllerDep, body: EmptyBody | None = None) -> dict:
    """Run freely; a pending run_until is disarmed (breakpoints stay)."""
    controller.resume()
    return {"controller": controller.status()}


@router.post("/step", dependencies=control, responses=JSON_ONLY)
async def step(controller: OpenControllerDep, session: SessionDep, body: StepBody | None = None) -> dict:
    """Run n steps (or phases, or kernel launches), then hold. With wait, answer once held (or
    once the timeout passed, or, with "idle": true and a "detail", soon when the engine has no request)."""
    body = body or StepBody()
    controller.step(body.n, body.granularity)
    out: dict = {"controller": controller.status()}
    if body.wait:
        stop, idle = await _wait_for_stop(controller, session, body.timeout)
        if stop is None and controller.closed:  # the wait ended because the server began to drain
            raise _closed_error()
        out = {"controller": controller.status(), "stop": _stop_dict(stop), "timed_out": stop is None and not idle,
               "idle": idle}
        if idle:
            out["detail"] = IDLE_DETAIL
    return out


async def _wait_for_stop(controller: StepController, session: TraceSession, timeout: float):
    """(where the engine stopped, or None; whether it answered early because the engine is idle).
    An engine with no request runs no step: after IDLE_WAIT seconds with none in it, the answer
    says so rather than leave the client waiting its whole timeout for a stop that cannot come."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        # wait_until_paused blocks on a threading.Condition: keep it off the event loop
        stop = await asyncio.to_thread(controller.wait_until_paused, max(0.0, min(left, IDLE_WAIT)))
        if stop is not None or controller.closed or left <= IDLE_WAIT:
            return stop, False
        view = session.state.view()
        if not (view.waiting or view.running):
            return None, True


@router.post("/run_until", dependencies=control, responses=JSON_ONLY)
async def run_until(body: ConditionBody, controller: OpenControllerDep) -> dict:
    """Run until an event matches the condition (once), then hold. Resume disarms it."""
    controller.run_until(_condition(body.condition))
    return {"controller": controller.status()}


@router.delete("/run_until", dependencies=control)
async def cancel_run_until(controller: ControllerDep) -> dict:
    """Disarm a pending run_until (a held engine stays held)."""
    controller.cancel_run_until()
    return {"controller": controller.status()}


# ---- breakpoints ----------------------------------------------------------------------------
class _BreakpointIds:
    """Stable ids for the controller's breakpoints, including ones added in-process (the TUI,
    a lesson): the controller keeps conditions, this numbers them the first time it sees them."""

    def __init__(self) -> None:
        self._ids: dict[Condition, int] = {}
        self._next = 1

    def id_of(self, cond: Condition) -> int:
        if cond not in self._ids:
            self._ids[cond], self._next = self._next, self._next + 1
        return self._ids[cond]

    def listing(self, controller: StepController) -> list[dict]:
        return [self.describe(c) for c in dict.fromkeys(controller.breakpoints)]

    def describe(self, cond: Condition) -> dict:
        return {"id": self.id_of(cond), "condition": str(cond), "layer": cond.layer, "name": cond.name,
                "request_id": cond.request_id}

    def find(self, controller: StepController, bp_id: int) -> Condition | None:
        return next((c for c in controller.breakpoints if self._ids.get(c) == bp_id), None)


def _breakpoint_ids(request: Request) -> _BreakpointIds:
    state = request.app.state
    if getattr(state, "trace_breakpoint_ids", None) is None:
        state.trace_breakpoint_ids = _BreakpointIds()  # the event loop is single-threaded: no race
    return state.trace_breakpoint_ids


IdsDep = Annotated[_BreakpointIds, Depends(_breakpoint_ids)]


@router.get("/breakpoints")
async def list_breakpoints(controller: ControllerDep, ids: IdsDep) -> dict:
    return {"breakpoints": ids.listing(controller)}


@router.post("/breakpoints", status_code=201, dependencies=control, response_model=Breakpoint,
             responses=JSON_ONLY | {200: {"model": Breakpoint, "description": "it existed already: returned as is"}})
async def add_breakpoint(body: ConditionBody, controller: OpenControllerDep, ids: IdsDep, response: Response) -> dict:
    """Hold the engine whenever an event matches. Adding one that exists returns it (200)."""
    cond = _condition(body.condition)
    if cond in controller.breakpoints:
        response.status_code = 200
    else:
        controller.add_breakpoint(cond)
    return ids.describe(cond)


@router.delete("/breakpoints/{bp_id}", status_code=204, response_class=Response, dependencies=control)
async def delete_breakpoint(bp_id: Annotated[int, Path(ge=0, le=MAX_ID)], controller: ControllerDep,
                            ids: IdsDep) -> Response:
    cond = ids.find(controller, bp_id)
    if cond is None:
        raise APIError(404, f"no breakpoint with id {bp_id}", param="id", code="breakpoint_not_found")
    controller.remove_breakpoint(cond)
    return Response(status_code=204)
