"""Pause / step / breakpoints, deterministic: the engine runs in a thread, the test waits on
the controller's condition (wait_until_paused), never on time. Tests that take `mode` run
twice: the engine in this process, and the engine core in its own (the controller remote)."""
import threading

import pytest
from tracer_helpers import CoreProcess, start_loop

from engine import LLM, Hooks, SamplingParams
from engine.worker.input_batch import INPUT_KERNELS
from tracer.conditions import on_arrive, on_finish, on_kernel, on_preempt, parse_condition
from tracer.controller import StepController
from tracer.session import TraceSession

T = 30  # seconds; only reached if something is broken
BOTH = ["inproc", "mp"]
_cores: list[CoreProcess] = []


@pytest.fixture(params=["inproc", pytest.param("mp", marks=pytest.mark.slow)])
def mode(request):
    """The engine in this process, or its core in its own ("mp": make test-slow, except for tests that name both
    modes themselves with parametrize("mode", BOTH, indirect=True))."""
    yield request.param
    while _cores:
        _cores.pop().close()


def make(start_paused=True, mode="inproc", **llm_kwargs):
    hooks = Hooks()
    session = TraceSession(hooks, start_paused=start_paused, remote_control=mode == "mp")
    llm_kwargs.setdefault("block_size", 4)
    if mode == "mp":
        _cores.append(CoreProcess(session, **llm_kwargs))
        return session, _cores[-1]
    engine = LLM("tiny-gpt2", hooks=hooks, **llm_kwargs).llm_engine
    return session, engine


def greedy(n):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("mode", BOTH, indirect=True)
def test_start_paused_step_and_requests_arriving_while_paused(mode):
    session, engine = make(mode=mode, async_scheduling=True)  # (the default with CUDA)
    ctl = session.controller
    engine.add_request("a", "first prompt", greedy(6))
    loop = start_loop(engine)
    try:
        stop = ctl.wait_until_paused(T)
        assert (stop.point, stop.step, stop.reason) == ("step", 0, "start paused")
        engine.add_request("b", "arrives while paused", greedy(2))  # not gated
        view = session.state.view()
        assert view.waiting == ["a", "b"] and view.step is None
        ctl.step()
        stop = ctl.wait_until_paused(T)
        assert (stop.point, stop.step) == ("step", 1)
        view = session.state.view()
        # async scheduling: n ran one call, which scheduled step 0 (sampled); its tokens come with the next
        assert view.step == 0 and view.phase == "postprocess" and view.running == ["a", "b"]
        assert view.in_flight == [[0, "sampled"]] and view.requests["a"].output_token_ids == []
        # the call about to run schedules step 1, with step 0 in flight
        assert view.paused_at == {"point": "step", "reason": "step step", "info": {"in_flight": [0], "schedules": True}}
        ctl.step(2)
        assert ctl.wait_until_paused(T).step == 3
        ctl.resume()
        loop.join(T)
    finally:
        session.close()
    steps = engine.step_count if mode == "mp" else engine.engine_core.engine_core.step_count
    # async scheduling (the default): once resumed, the step after the last one may be scheduled (empty)
    # while the one that finishes "a" is in flight, as in V1
    assert steps in (6, 7) and not engine.has_unfinished_requests()


# EngineCore.step as vLLM 0.33's: schedule -> execute_model -> grammar bitmask -> sample_tokens ->
# update_from_output. At "execute" the schedule is decided (snapshot in view) but nothing has run yet.
SYNC_PHASES = [("execute", 0, "schedule"), ("grammar_bitmask", 0, "execute"), ("sample_tokens", 0, "execute"),
               ("postprocess", 0, "postprocess"), ("step", 1, "done"), ("execute", 1, "schedule")]
# step_with_batch_queue: step 0 launched, the call returns; the next schedules step 1 before step 0's
# update_from_output (postprocess 0 comes after step 1's sample_tokens): two steps in flight
ASYNC_PHASES = [("execute", 0, "schedule", [[0, "scheduled"]]), ("grammar_bitmask", 0, "execute", [[0, "executing"]]),
                ("sample_tokens", 0, "execute", [[0, "executing"]]), ("step", 1, "postprocess", [[0, "sampled"]]),
                ("execute", 1, "schedule", [[0, "sampled"], [1, "scheduled"]]),
                ("grammar_bitmask", 1, "execute", [[0, "sampled"], [1, "executing"]]),
                ("sample_tokens", 1, "execute", [[0, "sampled"], [1, "executing"]]),
                ("postprocess", 0, "postprocess", [[0, "sampled"], [1, "sampled"]]),
                ("step", 2, "postprocess", [[1, "sampled"]])]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_step_into_phases(mode, async_scheduling):
    session, engine = make(mode=mode, async_scheduling=async_scheduling)
    ctl = session.controller
    engine.add_request("a", "phases", greedy(2))
    loop = start_loop(engine)
    want = ASYNC_PHASES if async_scheduling else SYNC_PHASES
    try:
        ctl.wait_until_paused(T)
        seen = []
        for _ in want:
            ctl.step(1, "phase")
            stop = ctl.wait_until_paused(T)
            view = session.state.view()
            seen.append((stop.point, stop.step, view.phase) + ((view.in_flight,) if async_scheduling else ()))
        assert seen == want
        ctl.resume()
        loop.join(T)
    finally:
        session.close()


def test_n_runs_one_batch_queue_call_and_says_what_it_did(mode):
    """Async scheduling: n is one step_with_batch_queue call. The first schedules step 0 and returns;
    each later one schedules a step and executes (returns the outputs of) the one before it."""
    session, engine = make(mode=mode, async_scheduling=True)
    ctl = session.controller
    engine.add_request("a", "one call at a time", greedy(3))
    loop = start_loop(engine)
    try:
        ctl.wait_until_paused(T)
        seen = []
        for _ in range(3):
            ctl.step(1, "step")
            stop = ctl.wait_until_paused(T)
            view = session.state.view()
            seen.append((stop.point, stop.step, view.last_call, view.in_flight, view.done_step))
        assert seen == [("step", 1, {"scheduled": 0, "executed": None}, [[0, "sampled"]], None),
                        ("step", 2, {"scheduled": 1, "executed": 0}, [[1, "sampled"]], 0),
                        ("step", 3, {"scheduled": 2, "executed": 1}, [[2, "sampled"]], 1)]
        ctl.resume()
        loop.join(T)
    finally:
        session.close()


def test_breakpoint_on_finish_and_run_until_preempted(mode):
    session, engine = make(mode=mode, num_kv_blocks=7, max_num_batched_tokens=16)  # 6 usable besides the null block
    ctl = session.controller
    for i in range(3):
        engine.add_request(str(i), f"prompt {i} is long", greedy(6 - i))
    ctl.add_breakpoint(on_finish("2"))
    loop = start_loop(engine)
    try:
        ctl.wait_until_paused(T)
        ctl.run_until(on_preempt())
        stop = ctl.wait_until_paused(T)
        assert stop.reason == "until preempt" and stop.point == "execute"  # right after the schedule that preempted
        view = session.state.view()
        preempted = view.snapshot["preempted"]
        assert preempted and all(view.requests[r].status == "PREEMPTED" for r in preempted)
        ctl.resume()
        stop = ctl.wait_until_paused(T)
        assert stop.reason == "breakpoint finish:2"
        assert session.state.view().requests["2"].finish_reason == "length"
        ctl.clear_breakpoints()
        ctl.resume()
        loop.join(T)
    finally:
        session.close()



def test_resume_and_cancel_disarm_a_run_until(mode):
    """A run-until that never matches: cancelled while held, the engine stays held; after
    resume (which disarms it, here or in the core's process) the engine runs to the end."""
    session, engine = make(mode=mode)
    ctl = session.controller
    # work enough that the pause sent after each run_until reaches a running engine: with the core in its own
    # process, three synchronous steps ended the request before the pause arrived, and nothing was left to hold
    engine.add_request("a", "disarm", greedy(40))
    loop = start_loop(engine)
    try:
        assert ctl.wait_until_paused(T) is not None
        ctl.add_breakpoint(on_arrive())  # armed beside it: stays through both
        ctl.pause()
        ctl.run_until(on_finish("nobody"))
        ctl.pause()
        assert ctl.wait_until_paused(T) is not None
        ctl.cancel_run_until()
        assert ctl.status()["until"] is None and ctl.held is not None
        ctl.run_until(on_finish("nobody"))
        ctl.pause()
        assert ctl.wait_until_paused(T) is not None and ctl.status()["until"] == "finish:nobody"
        ctl.resume()
        assert ctl.status()["until"] is None and len(ctl.breakpoints) == 1
        loop.join(T)
        assert session.state.view().requests["a"].status == "FINISHED_LENGTH"
    finally:
        session.close()

@pytest.mark.slow
def test_pause_while_running_and_arrive_breakpoint():
    session, engine = make(start_paused=False)
    ctl = session.controller

    def arrive_after_step_2(layer, name, kind, rid, step, attrs):
        # on the engine thread, so the arrival cannot race the scheduler
        if (layer, name, kind, step) == ("engine", "step", "end", 2):
            engine.add_request("b", "late", greedy(1))

    session.hooks.subscribe(arrive_after_step_2)
    engine.add_request("a", "runs", greedy(40))
    ctl.add_breakpoint(on_arrive())
    loop = start_loop(engine)
    try:
        stop = ctl.wait_until_paused(T)  # at the first control point after the arrival
        assert (stop.reason, stop.point, stop.step) == ("breakpoint arrive", "step_end", 2)
        assert session.state.view().waiting == ["b"]
        ctl.remove_breakpoint(on_arrive())
        ctl.resume()
        ctl.pause()
        stop = ctl.wait_until_paused(T)
        assert stop.point == "step" and stop.reason == "pause"
        assert ctl.status()["paused"] and ctl.status()["breakpoints"] == []
    finally:
        session.close()  # releases the engine
    loop.join(T)
    assert not engine.has_unfinished_requests()


class FakeKernelEngine:
    """Steps with a kernel gate before each launch, as the kernels integration provides; the steps
    in `launchless` launch nothing."""

    KERNELS = ["reshape_and_cache", "unified_attention"] * 2

    def __init__(self, hooks, steps, launchless=()):
        self.hooks, self.steps, self.launchless = hooks, steps, launchless

    def run(self):
        for s in range(self.steps):
            self.hooks.gate("step", step=s)
            self.hooks.gate("execute", step=s)
            for layer, name in enumerate(self.KERNELS if s not in self.launchless else ()):
                self.hooks.gate("kernel", step=s, name=name, layer=layer // 2)
                self.hooks.emit("kernel", name, step=s, grid=[4, 1], duration_ns=100)
            for point in ("grammar_bitmask", "sample_tokens", "postprocess"):
                self.hooks.gate(point, step=s)
            self.hooks.gate("step_end", step=s)


def test_step_kernel_runs_to_the_next_launch_and_kernel_breakpoints():
    """k is "the next kernel launch", across phase and step boundaries (it used to stop at each of
    them too, which read as a launch done); a step that launches nothing stops it at its end."""
    hooks = Hooks()
    ctl = StepController(hooks, start_paused=True)
    fake = FakeKernelEngine(hooks, steps=4, launchless={1})
    t = threading.Thread(target=fake.run, daemon=True)
    t.start()
    try:
        assert ctl.wait_until_paused(T).point == "step"
        stops = []
        for _ in range(6):
            ctl.step(1, "kernel")
            s = ctl.wait_until_paused(T)
            stops.append((s.step, s.point, s.info.get("name"), s.info.get("layer")))
        assert stops == [
            (0, "kernel", "reshape_and_cache", 0),
            (0, "kernel", "unified_attention", 0),
            (0, "kernel", "reshape_and_cache", 1),
            (0, "kernel", "unified_attention", 1),
            (1, "step_end", None, None),  # past step 0's postprocess and step 1's start: no launch in step 1
            (2, "kernel", "reshape_and_cache", 0),
        ]
        ctl.step(1, "phase")
        assert ctl.wait_until_paused(T).point == "grammar_bitmask"
        ctl.step(1, "kernel")  # from after the forward pass: straight to the next step's first launch
        s = ctl.wait_until_paused(T)
        assert (s.step, s.point, s.info["name"], s.reason) == (3, "kernel", "reshape_and_cache", "step kernel")
        ctl.add_breakpoint(on_kernel("unified_attention"))
        ctl.resume()
        s = ctl.wait_until_paused(T)  # before the launch
        assert (s.point, s.step, s.info["name"], s.reason) == ("kernel", 3, "unified_attention",
                                                              "breakpoint kernel:unified_attention")
        ctl.resume()
        assert ctl.wait_until_paused(T).info["layer"] == 1  # the next unified_attention, not the same one twice
        ctl.close()
        t.join(T)
        assert not t.is_alive()
    finally:
        ctl.close()


def test_bad_commands_and_condition_text():
    ctl = StepController(Hooks())
    with pytest.raises(ValueError, match="granularity"):
        ctl.step(1, "token")
    with pytest.raises(ValueError):
        ctl.step(0)
    assert ctl.wait_until_paused(0.01) is None
    assert parse_condition("finish:3") == on_finish("3")
    assert parse_condition("kernel:unified_attention").matches("kernel", "unified_attention", None)
    assert parse_condition("layer:sampler").matches("sampler", "sampled", None)
    assert parse_condition("request:7").matches("detokenizer", "NEW_TOKENS", "7")
    assert not parse_condition("finish").matches("engine", "QUEUED", "1")
    assert parse_condition("finish").matches("engine", "ABORTED", "1")
    for bad in ("nope", "layer:gpu", "event:x", "finish:", "kernel:", "arrive: ", "preempt:", "event:engine.",
                "event:.FINISHED", "layer:", "request:"):
        with pytest.raises(ValueError):
            parse_condition(bad)


def test_controller_is_on_the_hooks_only_while_armed():
    # Unarmed, the controller must cost the engine nothing: no listener, no gate.
    hooks = Hooks()
    ctl = StepController(hooks)
    assert hooks._listeners == [] and hooks._gates == [] and not hooks.active
    ctl.pause()  # a command that may stop the engine: the gate is on, events are not watched
    assert hooks._gates and hooks._listeners == [] and hooks.gated
    ctl.resume()
    assert hooks._gates == [] and not hooks.active
    ctl.add_breakpoint(on_finish("1"))
    ctl.add_breakpoint(on_arrive())
    assert len(hooks._listeners) == 1 and len(hooks._gates) == 1
    ctl.remove_breakpoint(on_finish("1"))
    assert len(hooks._listeners) == 1
    ctl.clear_breakpoints()
    assert hooks._listeners == [] and hooks._gates == []
    ctl.run_until(on_finish("7"))
    assert len(hooks._listeners) == 1
    hooks.emit("engine", "FINISHED", request_id="7")  # matched: the run-until is used up...
    assert hooks._listeners == [] and "finish:7" in ctl._hit
    assert hooks._gates  # ...but its hit still needs the gate, to stop at the next control point
    ctl.add_breakpoint(on_arrive())
    ctl.close()
    assert hooks._listeners == [] and hooks._gates == [] and not hooks.active
    assert StepController(Hooks(), start_paused=True).hooks.gated  # held before the first step


def test_a_step_command_gates_the_engine_until_it_is_used_up():
    hooks = Hooks()
    ctl = StepController(hooks)
    ctl.step(2)
    assert hooks.gated
    hooks.gate("step", step=0)  # one of two: passes
    assert ctl.held is None and hooks.gated
    t = threading.Thread(target=hooks.gate, args=("step",), kwargs={"step": 1})
    t.start()
    assert ctl.wait_until_paused(timeout=5).reason == "step step"
    assert hooks.gated  # held: the gate that holds it stays until the release
    ctl.resume()
    t.join(timeout=5)
    assert not t.is_alive() and not hooks.gated and not hooks.active


def test_a_viewer_held_before_a_launch_sees_every_launch_before_it(mode):
    """A step's launch events are published together once its forward pass is done (each with
    the time it ended), unless the engine may be held before a launch: a viewer stopped at a
    launch then sees each earlier one of the step."""
    session, engine = make(mode=mode)
    ctl = session.controller
    engine.add_request("a", "kernels", greedy(2))
    loop = start_loop(engine)
    try:
        ctl.wait_until_paused(T)
        seen = []
        while len(seen) < 8:
            ctl.step(1, "kernel")
            stop = ctl.wait_until_paused(T)
            if stop.point == "kernel":
                shown = [e.name for e in session.bus.read(0)[0] if e.layer == "kernel" and e.step == stop.step]
                seen.append((stop.step, stop.info["name"], shown))
        ctl.resume()
        loop.join(T)
    finally:
        session.close()
    # the step's inputs are built first (four launches), then each layer writes its cache and attends (a short
    # prompt: on a CPU, in the C kernel)
    names = [f"{k}_ref" for k in INPUT_KERNELS[:4]] + ["reshape_and_cache_ref", "cpu_attention_with_kv_cache"] * 2
    assert seen == [(0, name, names[:i]) for i, name in enumerate(names)]


def test_launch_events_keep_the_time_each_launch_ended():
    hooks = Hooks()
    with TraceSession(hooks) as session:
        llm = LLM("tiny-gpt2", hooks=hooks)
        llm.generate(["one", "two two"], greedy(3), use_tqdm=False)
        events = session.bus.read(0)[0]
    for step in range(3):
        ev = {(e.layer, e.name): e for e in events if e.step == step and e.layer in ("model_runner", "sampler")}
        kernels = [e for e in events if e.layer == "kernel" and e.step == step]
        ts = [e.ts_ns for e in kernels]
        assert len(kernels) == 13 and ts == sorted(set(ts))  # one launch after another, each its own time
        # the batch event follows the four launches that built it, and precedes the layers' launches; after
        # sampling, post_update writes the tokens back
        assert [e.name for e in kernels[:4]] == [f"{k}_ref" for k in INPUT_KERNELS[:4]]
        assert kernels[-1].name == "post_update_ref"
        assert ts[3] < ev["model_runner", "batch"].ts_ns < ts[4] and ts[-1] <= ev["sampler", "sampled"].ts_ns
        # published together once the forward pass is done (post_update once sampling is)
        assert [e.seq for e in kernels[:12]] == list(range(kernels[0].seq, kernels[0].seq + 12))


def test_the_breakpoint_dialogs_kernel_example_stops_on_this_machine(mode):
    """The dialog's example names the kernel; without a GPU the launch is the kernel standing in for it
    (on a CPU, the C kernel for a short prompt's prefill)."""
    import re

    from tracer.tui.screens.breakpoints import SYNTAX
    example = re.search(r"'(kernel:\w+)'", SYNTAX).group(1)
    assert parse_condition(example).matches("kernel", f"{example[7:]}_ref", None)
    assert not parse_condition("kernel:unified_attention_ref").matches("kernel", "unified_attention", None)
    session, engine = make(mode=mode)
    ctl = session.controller
    engine.add_request("a", "kernels", greedy(2))
    loop = start_loop(engine)
    try:
        ctl.wait_until_paused(T)
        ctl.add_breakpoint(parse_condition(example))
        ctl.resume()
        stop = ctl.wait_until_paused(T)
        assert (stop.point, stop.info["name"]) == ("kernel", "cpu_attention_with_kv_cache")
        assert stop.reason == f"breakpoint {example}"
        ctl.clear_breakpoints()
        ctl.resume()
        loop.join(T)
    finally:
        session.close()


def test_both_controllers_are_one_api_behind_one_base():
    """The in-process and the remote controller share their API's code, not a copy of it."""
    from tracer.controller import BaseStepController
    from tracer.remote_controller import RemoteStepController

    shared = ("step", "add_breakpoint", "remove_breakpoint", "clear_breakpoints", "breakpoints", "held", "closed",
              "wait_until_paused", "status")
    for cls in (StepController, RemoteStepController):
        assert issubclass(cls, BaseStepController) and not any(name in vars(cls) for name in shared), cls
    remote = RemoteStepController(Hooks())  # not bound: commands wait in its backlog
    with pytest.raises(ValueError, match="granularity"):
        remote.step(1, "token")
    remote.add_breakpoint(on_finish())
    assert remote.status()["breakpoints"] == ["finish"] and remote.status()["pause_requested"] is False
    remote.close()
