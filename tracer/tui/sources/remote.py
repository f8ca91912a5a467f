"""RemoteSource: `vllm-trace attach URL`, a server started elsewhere (e.g. with --no-tui).

It takes the server's folded state once (GET /trace/state), then follows /trace/events from
the next sequence number and folds the stream itself with the same fold, so it sees exactly
what an in-process viewer sees. If the stream reports missed events (the client fell a whole
ring behind), the fold can no longer be trusted: it takes /trace/state again. Commands are
the /trace/* control endpoints.

When the stream ends or breaks (the server stopped: its shutdown ends every stream, so this
is seen at once), the source says so (``disconnected()``, the header's DISCONNECTED) and
retries with backoff (RETRY_MIN doubling to RETRY_MAX seconds). A server that comes back may
be a new process with a new trace: the source takes /trace/state again before following.
"""
from __future__ import annotations

import asyncio
import json
from collections import deque

import httpx

from tracer.events import Event
from tracer.net import trust_env
from tracer.state import TraceState, fold
from tracer.tui.sources.base import EventBatch, LogBuffer, Source, SourceInfo, Unsupported, engine_identity

RETRY_MIN, RETRY_MAX = 0.25, 5.0  # seconds between reconnection attempts (doubling)
READ_TIMEOUT = 45.0  # the server sends a keep-alive every 15 s: silence this long is a dead server


class AttachError(Exception):
    """Nobody (or no trace API) answers at that URL."""


class AttachRefused(AttachError):
    """A vllm-trace server answers there, and refuses: the API key, tracing off, a public bind."""


def check_url(url: str) -> str:
    """The URL without its trailing slash; AttachError (one line) if it is no http(s) URL."""
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError) as e:
        raise AttachRefused(f"not a valid URL: {url!r} ({e})") from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise AttachRefused(f"not an http:// or https:// URL with a host: {url!r}")
    return url.rstrip("/")


def _refusal(resp: httpx.Response, url: str, has_key: bool) -> AttachRefused:
    try:
        message = resp.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = resp.reason_phrase
    if resp.status_code == 401:
        what = "refused the API key" if has_key else "wants an API key (--api-key or $VLLM_TRACE_API_KEY)"
        return AttachRefused(f"the server at {url} {what} (401: {message})")
    return AttachRefused(f"the server at {url} refused the trace API ({resp.status_code}: {message})")


class RemoteSource(Source):
    def __init__(self, url: str, api_key: str | None = None, transport: httpx.AsyncBaseTransport | None = None):
        self.url = check_url(url)
        self._has_key = bool(api_key)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.AsyncClient(base_url=self.url, headers=headers, timeout=10, transport=transport,
                                        trust_env=trust_env(self.url))
        self.info = SourceInfo("attach", url=self.url)
        self._state = TraceState()
        self._pending: deque[Event] = deque()
        self._log = LogBuffer()
        self._status: dict = {"paused": False, "breakpoints": []}
        self._breakpoints: list[dict] = []
        self._seq = 0
        self._offset_ns = 0  # server trace time minus our clock, from the last event seen
        self._task: asyncio.Task | None = None
        self.connected = False
        self.error: str | None = None

    async def start(self) -> None:
        try:
            resp = await self.client.get("/trace/state")
            if resp.status_code in (401, 403, 503) and resp.headers.get("content-type", "").startswith(
                    "application/json"):  # a vllm-trace server (its OpenAI error body) that says no
                raise _refusal(resp, self.url, self._has_key)
            await self._take_state()
            models = (await self.client.get("/v1/models")).json().get("data", [])
        except (httpx.HTTPError, ValueError, KeyError) as e:
            raise AttachError(f"no vllm-trace server with a trace API at {self.url} ({type(e).__name__}: {e})") from e
        if models:
            self.info.model = models[0]["id"]
        await self._take_breakpoints()
        self.connected = True
        self._task = asyncio.get_running_loop().create_task(self._follow())

    async def _take_state(self) -> None:
        resp = await self.client.get("/trace/state")
        resp.raise_for_status()
        d = resp.json()
        self._state = TraceState.from_dict(d["state"])
        self._status = d.get("controller") or self._status
        self._seq = d["seq"]  # the next event the server will publish
        self._pending.clear()
        self._sync_clock(self._state.last_ts_ns)
        self.info.device, self.info.backend = engine_identity(self._state)

    def _sync_clock(self, ts_ns: int) -> None:
        self._offset_ns = ts_ns - asyncio.get_running_loop().time() * 1e9 if ts_ns else self._offset_ns

    async def _follow(self) -> None:
        """Read the event stream until closed; when it drops, say so and reconnect with backoff."""
        delay, fresh = RETRY_MIN, True
        while True:
            try:
                if not fresh:  # perhaps another server process: its state, not our old fold
                    await self._take_state()
                    await self._take_breakpoints()
                async with self.client.stream("GET", "/trace/events", params={"since": self._seq},
                                              timeout=httpx.Timeout(10, read=READ_TIMEOUT)) as resp:
                    resp.raise_for_status()
                    self.connected, self.error, delay = True, None, RETRY_MIN
                    await self._read(resp)
                self.connected, self.error = False, "the server ended the event stream (stopped?)"
            except asyncio.CancelledError:
                raise
            except (httpx.HTTPError, ValueError, KeyError, OSError) as e:
                self.connected, self.error = False, _why(e)
            fresh = False
            await asyncio.sleep(delay)
            delay = min(RETRY_MAX, delay * 2)

    async def _read(self, resp: httpx.Response) -> None:
        kind = "message"
        async for line in resp.aiter_lines():
            if line.startswith("event:"):
                kind = line[6:].strip()
            elif line.startswith("data:"):
                data = json.loads(line[5:])
                if kind == "missed":
                    self._log.missed += data["count"]
                    await self._take_state()  # our fold skipped events: start again from theirs
                else:
                    ev = Event.from_dict(data)
                    self._seq = ev.seq + 1
                    self._pending.append(ev)
                kind = "message"
            elif not line:
                kind = "message"

    def disconnected(self) -> str | None:
        return None if self.connected or self._task is None else (self.error or "connecting")

    def refresh(self) -> TraceState:
        while self._pending:
            ev = self._pending.popleft()
            fold(self._state, ev)
            self._log.events.append(ev)
            self._sync_clock(ev.ts_ns)
        return self._state

    def take_events(self) -> EventBatch:
        return self._log.take()

    def now_ns(self) -> int:
        return int(asyncio.get_running_loop().time() * 1e9 + self._offset_ns)

    def controller(self) -> dict:
        # held or not is in the event stream (tracer paused / resumed), so it is never stale
        held = self._state.paused_at
        return {**self._status, "paused": held is not None, "point": held and held.get("point"),
                "reason": held and held.get("reason"), "step": held and self._state.step,
                "breakpoints": [b["condition"] for b in self._breakpoints]}

    # ---- commands ------------------------------------------------------------------------
    async def _post(self, path: str, body: dict | None = None) -> dict:
        resp = await self.client.post(path, json={} if body is None else body)  # JSON: the server requires it
        if resp.status_code >= 400:
            raise Unsupported(_error(resp))
        return resp.json() if resp.content else {}

    async def pause(self) -> None:
        self._status = (await self._post("/trace/pause"))["controller"]

    async def resume(self) -> None:
        self._status = (await self._post("/trace/resume"))["controller"]

    async def step(self, n: int = 1, granularity: str = "step") -> None:
        self._status = (await self._post("/trace/step", {"n": n, "granularity": granularity}))["controller"]

    async def start_profile(self) -> None:
        await self._post("/start_profile")

    async def stop_profile(self) -> None:
        await self._post("/stop_profile")

    async def add_breakpoint(self, condition: str) -> None:
        await self._post("/trace/breakpoints", {"condition": condition})
        await self._take_breakpoints()

    async def remove_breakpoint(self, condition: str) -> None:
        for bp in self._breakpoints:
            if bp["condition"] == condition:
                resp = await self.client.delete(f"/trace/breakpoints/{bp['id']}")
                if resp.status_code >= 400:
                    raise Unsupported(_error(resp))
        await self._take_breakpoints()

    async def _take_breakpoints(self) -> None:
        resp = await self.client.get("/trace/breakpoints")
        self._breakpoints = resp.json().get("breakpoints", []) if resp.status_code == 200 else []

    async def send_test_request(self, prompt: str, max_tokens: int = 16) -> str:
        body = {"model": self.info.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}

        async def send() -> None:
            async with self.client.stream("POST", "/v1/completions", json=body, timeout=None) as resp:
                async for _ in resp.aiter_bytes():
                    pass
        task = asyncio.get_running_loop().create_task(send())
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # a failed test request is no crash
        self._send_task = task
        return f"POST {self.url}/v1/completions"

    async def export(self, path: str) -> str:
        raise Unsupported("attach sees the stream from when it attached; record on the server with --trace-file")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        await self.client.aclose()


def _why(e: Exception) -> str:
    if isinstance(e, httpx.ConnectError):
        return "connection refused"
    if isinstance(e, httpx.ReadTimeout):
        return f"no data for {READ_TIMEOUT:.0f} s"
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def _error(resp: httpx.Response) -> str:
    try:
        return resp.json()["error"]["message"]
    except Exception:
        return f"HTTP {resp.status_code}"
