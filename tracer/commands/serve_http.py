"""uvicorn as `vllm-trace serve` runs it: started on a bound socket, stopped with a drain.

``DrainingServer`` is uvicorn's ``Server`` with serve's shutdown (see ``tracer/commands/serve.py``):
on Ctrl-C or SIGTERM it ends the /trace/events streams and lets a held engine run free (neither
would end on its own, and uvicorn waits for open connections), gives the requests in flight the
engine's drain (``EngineClient.shutdown``), and on a second signal of either kind aborts them at
once. uvicorn is imported here, not by serve's module: the CLI starts without it.
"""
from __future__ import annotations

import asyncio
import signal
import sys

import uvicorn

from tracer import trace_api


class DrainingServer(uvicorn.Server):
    """uvicorn's server, stopped with the engine's drain (see the module docstring).

    died: why the engine core died, if it did (filled by serve's death handler): nothing drains
    then. start(sock) serves and returns the serving task once uvicorn has started."""

    def __init__(self, config: uvicorn.Config, engine, session, drain_timeout: float, died: list[str]):
        super().__init__(config)
        self.engine, self.session = engine, session
        self.drain_timeout, self.died = drain_timeout, died
        self.ready = asyncio.Event()

    async def start(self, sock) -> asyncio.Task:
        """Serve on sock until stopped; returns once uvicorn has started (self.started) or failed to."""
        serving = asyncio.create_task(self.serve(sockets=[sock]))
        waiter = asyncio.create_task(self.ready.wait())
        await asyncio.wait({serving, waiter}, return_when=asyncio.FIRST_COMPLETED)
        if not self.ready.is_set():
            waiter.cancel()
        return serving

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            self.ready.set()

    def handle_exit(self, sig, frame) -> None:
        if self.should_exit and sig in (signal.SIGINT, signal.SIGTERM):
            self._captured_signals.append(sig)
            self.force_exit = True  # a second signal, of either kind (uvicorn: only a second SIGINT)
        else:
            super().handle_exit(sig, frame)

    async def shutdown(self, sockets=None) -> None:
        # before uvicorn waits for open connections: /trace/events streams would never end
        # on their own, and a held engine could not drain the requests in flight
        trace_api.stop_event_streams(self.config.app)
        if self.session is not None and self.session.controller is not None:
            self.session.controller.close()
        self._say_what_drains()
        # The drain's deadline is the engine's: it ends what still runs with an error each
        # response reports, before uvicorn's timeout (DRAIN_GRACE later) would cut them.
        drain = asyncio.ensure_future(self.engine.shutdown(self.drain_timeout))
        await super().shutdown(sockets)
        if self.force_exit:
            # A second Ctrl-C: uvicorn skips the app's shutdown, whose task asyncio.run would
            # then cancel (a traceback logged by Starlette). Stop the engine now, without
            # waiting for the requests in flight, which are aborted.
            self.engine.drain_timeout = 0
            await self.lifespan.shutdown()
            if self.server_state.tasks:  # their streams end now, as aborted: let them say so
                await asyncio.wait(list(self.server_state.tasks), timeout=2)
        await drain
        # uvicorn re-raises a caught Ctrl-C once it has shut down (exit 130 with a
        # KeyboardInterrupt); ours was handled, requests drained: exit 0 instead
        self._captured_signals.clear()

    def _say_what_drains(self) -> None:
        stats = self.engine.stats
        in_flight = stats.num_running + stats.num_waiting
        if in_flight and not self.died:  # after a death they have already failed: nothing drains
            print(f"vllm-trace serve: stopping; {in_flight} request(s) in flight get --drain-timeout "
                  f"{self.drain_timeout:g} s to finish (a second Ctrl-C or SIGTERM aborts them now)",
                  file=sys.stderr, flush=True)
