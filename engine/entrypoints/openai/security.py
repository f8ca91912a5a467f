"""Access guards, as FastAPI dependencies.

* ``require_api_key``: with ``--api-key`` set, the OpenAI routes (/v1/...) need
  ``Authorization: Bearer KEY`` (as in vLLM; /health, /version, /metrics stay open).
* ``require_trace_read``: for trace reads (/trace/state, /trace/events, the breakpoint list),
  which show every user's prompts and outputs. With a key, the key is required. Without one,
  they answer only while the server is bound to a loopback address.
* ``require_control``: for endpoints that change what the engine does (trace pause, step,
  breakpoints, profiling, the prefix-cache reset). The same rule as reads (anyone who can reach
  a public port could otherwise freeze the engine), and a POST sent by a web page (a browser
  names the page's ``Origin`` on every POST) must say ``Content-Type: application/json``: a page
  open in the learner's browser can POST a form cross-site to 127.0.0.1 without asking, but not
  JSON, which needs a CORS preflight that this server never grants (415 otherwise). A POST with
  no Origin comes from a program (curl, a script), so a bare ``curl -X POST .../start_profile``
  works as it does on vLLM. DELETE needs no such check: a page cannot send one cross-site
  without a preflight either.
"""
from __future__ import annotations

import hmac
import ipaddress

from fastapi import Depends, Request

from engine.entrypoints.openai.errors import APIError
from engine.entrypoints.openai.state import ServerState, get_state


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: we cannot know what it resolves to
        return False


def control_refusal(host: str, api_key: str | None) -> str | None:
    """Why trace endpoints refuse, or None when they are open. Shown in the startup banner."""
    if api_key is None and not is_loopback(host):
        return (f"trace endpoints are disabled: the server listens on {host}, which is not a "
                f"loopback address, and no --api-key is set")
    return None


def _check_key(request: Request, state: ServerState) -> None:
    auth = request.headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), state.api_key.encode()):
        raise APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'.",
                       code="invalid_api_key")


async def require_api_key(request: Request, state: ServerState = Depends(get_state)) -> None:
    if state.api_key is not None:
        _check_key(request, state)


def _key_or_loopback(request: Request, state: ServerState, code: str) -> None:
    if state.api_key is not None:
        _check_key(request, state)
        return
    reason = control_refusal(state.host, state.api_key)
    if reason is not None:
        raise APIError(403, reason + "; restart with --api-key or bind 127.0.0.1", code=code)


async def require_trace_read(request: Request, state: ServerState = Depends(get_state)) -> None:
    _key_or_loopback(request, state, "trace_disabled")


async def require_control(request: Request, state: ServerState = Depends(get_state)) -> None:
    _key_or_loopback(request, state, "control_disabled")
    if request.method == "POST" and "origin" in request.headers:
        media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
        if media_type != "application/json":
            raise APIError(415, "trace control from a web page needs 'Content-Type: application/json' (send a "
                                "JSON body, '{}' if there is nothing to say): it keeps pages from pausing the engine",
                           code="json_required")
