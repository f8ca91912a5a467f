"""`vllm-trace attach`: the TUI driving a server in another thread over the /trace/* API,
against a real engine behind the real router (skipped until the trace API is merged)."""
from __future__ import annotations

import asyncio
import socket
import threading

import pytest
import uvicorn

trace_api = pytest.importorskip("tracer.trace_api", reason="the /trace/* router (tracer/trace_api.py) is not here yet")

from engine import LLM, Hooks  # noqa: E402
from engine.engine.async_llm import AsyncLLM  # noqa: E402
from engine.entrypoints.openai import build_app  # noqa: E402
from tracer.session import TraceSession  # noqa: E402
from tracer.tui.app import TraceApp  # noqa: E402
from tracer.tui.sources.remote import AttachError, RemoteSource  # noqa: E402

pytestmark = pytest.mark.asyncio


class Server(uvicorn.Server):
    def __init__(self, config):
        super().__init__(config)
        self.ready = threading.Event()

    async def startup(self, sockets=None):
        await super().startup(sockets)
        self.ready.set()


def start_server(port: int = 0, start_paused: bool = True, api_key: str | None = None):
    """A real engine behind the real router, in a thread: (url, session, stop)."""
    hooks = Hooks()
    session = TraceSession(hooks, start_paused=start_paused, model="tiny-gpt2")
    llm = LLM("tiny-gpt2", hooks=hooks, block_size=4, num_kv_blocks=64)
    engine = AsyncLLM.from_engine_core(llm.llm_engine.engine_core.engine_core, drain_timeout=0)
    app = build_app(engine, "tiny-gpt2", api_key)
    app.state.trace = session
    app.include_router(trace_api.router)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    server = Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    assert server.ready.wait(60)

    def stop() -> None:  # as serve stops: its /trace/events streams end first, or uvicorn waits for them
        trace_api.stop_event_streams(app)
        server.should_exit = True
        thread.join(30)
        session.close()
        sock.close()
    return f"http://127.0.0.1:{sock.getsockname()[1]}", session, stop


@pytest.fixture
def served(model_cache):
    url, session, stop = start_server()
    yield url, session
    stop()


async def until(app, check, what: str, timeout: float = 20):
    """The stream arrives over HTTP: refresh until the TUI's state shows it."""
    for _ in range(int(timeout / 0.05)):
        app.tick()
        if check(app.source.refresh()):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


async def test_attach_sees_requests_and_steps_the_remote_engine(served):
    url, session = served
    source = RemoteSource(url)
    await source.start()
    assert source.info.model == "tiny-gpt2" and source.refresh().num_blocks == 64
    assert (source.info.device, source.info.backend) == ("cpu", "cpu")  # what the engine uses, not "?"
    app = TraceApp(source, initial_pane="requests")
    async with app.run_test(size=(120, 36)) as pilot:
        await pilot.press("ctrl+p", *"send a test", "enter")
        await until(app, lambda s: len(s.waiting) == 1, "the test request to wait in the remote engine")
        await pilot.press("n")
        stop = await asyncio.to_thread(session.controller.wait_until_paused, 30)
        assert stop is not None and stop.step == 1  # exactly one step ran on the server
        await until(app, lambda s: s.step == 0 and len(s.running) == 1, "step 0 in the attached TUI")
        rid = source.refresh().running[0]
        assert source.refresh().requests[rid].block_table == session.state.view().requests[rid].block_table
        await until(app, lambda s: s.paused_at is not None, "the held engine")
        assert source.controller()["paused"]

        await source.add_breakpoint("finish")
        assert [str(b) for b in session.controller.breakpoints] == ["finish"]
        await pilot.press("space")
        await until(app, lambda s: rid in s.finished, "the request to finish")
        await source.remove_breakpoint("finish")
        assert session.controller.breakpoints == ()


async def test_attach_to_nothing_is_one_clear_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    source = RemoteSource(f"http://127.0.0.1:{port}")
    with pytest.raises(AttachError, match="no vllm-trace server"):
        await source.start()
    await source.close()


@pytest.mark.slow
async def test_attach_says_what_is_wrong_in_one_line(model_cache, capsys, monkeypatch):
    """A wrong key used to read as "no vllm-trace server ... is `vllm-trace serve` running there?";
    a malformed URL was a 14-frame httpx.InvalidURL traceback."""
    from tracer.cli import main

    def error(*argv: str) -> str:
        assert main(["attach", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and "Traceback" not in err, err
        return err

    monkeypatch.delenv("VLLM_TRACE_API_KEY", raising=False)
    url, _, stop = start_server(api_key="sesame")
    try:
        wrong = await asyncio.to_thread(error, url, "--api-key", "wrong")
        assert wrong.startswith(f"vllm-trace attach: error: the server at {url} refused the API key (401: "), wrong
        assert "running there" not in wrong
        none = await asyncio.to_thread(error, url)
        assert f"the server at {url} wants an API key (--api-key or $VLLM_TRACE_API_KEY)" in none
    finally:
        stop()
    assert (await asyncio.to_thread(error, "http://[::1")).startswith(
        "vllm-trace attach: error: not a valid URL: 'http://[::1'")
    assert "not an http:// or https:// URL" in await asyncio.to_thread(error, "ftp://127.0.0.1:1")


@pytest.mark.slow
async def test_attach_shows_the_server_going_away_and_reconnects_when_it_is_back(model_cache):
    from tests.tui.helpers import shown
    from tracer.tui.widgets.header import StatusHeader

    url, session, stop = start_server(start_paused=False)
    port = int(url.rsplit(":", 1)[1])
    source = RemoteSource(url)
    await source.start()
    app = TraceApp(source)
    async with app.run_test(size=(120, 36)):
        header = app.query_one(StatusHeader)
        await until(app, lambda s: source.connected, "the event stream")
        assert "RUNNING" in shown(header) and "cpu · cpu" in shown(header)
        await asyncio.to_thread(stop)  # the server stops (as on Ctrl-C: its streams end)
        t0 = asyncio.get_running_loop().time()
        await until(app, lambda s: "DISCONNECTED" in shown(header), "DISCONNECTED", timeout=10)
        assert asyncio.get_running_loop().time() - t0 < 2.0
        assert "lost the server" in shown(header) and "RUNNING" not in shown(header)
        url2, session2, stop2 = await asyncio.to_thread(start_server, port, False)  # back, a new process
        try:
            await until(app, lambda s: "DISCONNECTED" not in shown(header), "the reconnection", timeout=30)
            await pilot_send(app)
            await until(app, lambda s: len(s.finished) == 1, "a request served by the new server", timeout=60)
        finally:
            await asyncio.to_thread(stop2)


async def pilot_send(app) -> None:
    await app.source.send_test_request("Hello", max_tokens=2)


@pytest.mark.slow
async def test_p_in_an_attached_tui_profiles_the_remote_engine(served):
    url, session = served
    source = RemoteSource(url)
    await source.start()
    app = TraceApp(source, initial_pane="requests")
    async with app.run_test(size=(160, 48)) as pilot:
        await pilot.press("ctrl+p", *"send a test", "enter")
        await until(app, lambda s: len(s.waiting) == 1, "the test request to wait in the remote engine")
        await pilot.press("p")  # POST /start_profile: applied at the next step boundary
        for _ in range(3):
            await pilot.press("n")
            await asyncio.to_thread(session.controller.wait_until_paused, 30)
            app.tick()
            if any(k.get("profiled") for k in source.refresh().kernels):
                break
        await until(app, lambda s: s.profiling and any(k.get("profiled") for k in s.kernels), "a profiled step")
        assert app.panes.active == "kernels"
        await pilot.press("p")  # POST /stop_profile
        await pilot.press("n")
        await until(app, lambda s: not s.profiling, "profiling to stop")


@pytest.mark.slow
async def test_serves_own_tui_profiles_through_the_servers_endpoints(served):
    """`serve`'s TUI holds no handle on the engine: its LiveSource posts /start_profile to its own URL."""
    from tracer.tui.sources.base import SourceInfo
    from tracer.tui.sources.live import LiveSource

    url, session = served
    source = LiveSource(session, SourceInfo("live", "tiny-gpt2", "cpu", "torch", url=url), None)
    try:
        await source.start_profile()
        assert session.state.view().profiling or any(
            e.layer == "profiler" and e.name == "start" for e in session.bus.read(0)[0])
        await source.stop_profile()
        assert any(e.layer == "profiler" and e.name == "stop" for e in session.bus.read(0)[0])
    finally:
        await source.close()


@pytest.mark.slow
async def test_attach_to_two_servers_shows_one_at_a_time_and_i_shows_the_next(model_cache):
    """`attach URL1 URL2` (a prefill and a decode instance): both followed, one shown; `i` switches, the
    header names the one shown, and a request sent to it appears there and not in the other."""
    from tests.tui.helpers import shown
    from tracer.tui.sources.instances import InstancesSource
    from tracer.tui.widgets.header import StatusHeader

    (url1, session1, stop1), (url2, session2, stop2) = start_server(), start_server()
    sources = [RemoteSource(url1), RemoteSource(url2)]
    source = InstancesSource(sources)
    try:
        await source.start()
        app = TraceApp(source, initial_pane="requests")
        async with app.run_test(size=(140, 36)) as pilot:
            header = app.query_one(StatusHeader)
            app.tick()
            assert f"[1/2] {url1}" in shown(header)
            await pilot.press("i")
            assert f"[2/2] {url2}" in shown(header) and app.source.source is sources[1]
            await app.source.send_test_request("Hello", max_tokens=2)  # to the instance shown
            await until(app, lambda s: len(s.waiting) == 1, "the request waiting in the second server")
            rid = app.frame.state.waiting[0]
            assert rid in session2.state.view().requests and not session1.state.view().requests
            await pilot.press("i")
            app.tick()
            assert f"[1/2] {url1}" in shown(header) and not app.frame.state.requests
            assert rid in sources[1].refresh().requests  # still followed while not shown
    finally:
        await source.close()
        stop1()
        stop2()
