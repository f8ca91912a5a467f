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
from engine.async_engine import AsyncLLMEngine  # noqa: E402
from engine.server import build_app  # noqa: E402
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


@pytest.fixture
def served(model_cache):
    hooks = Hooks()
    session = TraceSession(hooks, start_paused=True, model="tiny-gpt2")
    engine = AsyncLLMEngine(LLM("tiny-gpt2", hooks=hooks, block_size=4, num_kv_blocks=64).llm_engine, drain_timeout=0)
    app = build_app(engine, "tiny-gpt2")
    app.state.trace = session
    app.include_router(trace_api.router)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    assert server.ready.wait(60)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}", session
    session.close()
    server.should_exit = True
    thread.join(30)


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
