"""Access guards, as FastAPI dependencies.

* ``require_api_key``: with ``--api-key`` set, the OpenAI routes (/v1/...) need
  ``Authorization: Bearer KEY`` (as in vLLM; /health, /version, /metrics stay open).
* ``require_control``: for endpoints that change what the engine does (trace pause, step,
  breakpoints). With a key, the key is required. Without one, they only work while the server
  is bound to a loopback address: anyone who can reach a public port could otherwise freeze
  the engine. Read-only endpoints should not use it.
"""
from __future__ import annotations

import hmac
import ipaddress

from fastapi import Depends, Request

from engine.server.errors import APIError
from engine.server.state import ServerState, get_state


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: we cannot know what it resolves to
        return False


def control_refusal(host: str, api_key: str | None) -> str | None:
    """Why control endpoints refuse, or None when they are open. Shown in the startup banner."""
    if api_key is None and not is_loopback(host):
        return (f"trace control endpoints are disabled: the server listens on {host}, which is not a "
                f"loopback address, and no --api-key is set")
    return None


def _check_key(request: Request, state: ServerState) -> None:
    auth = request.headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), state.api_key.encode()):
        raise APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'.",
                       code="invalid_api_key")


def require_api_key(request: Request, state: ServerState = Depends(get_state)) -> None:
    if state.api_key is not None:
        _check_key(request, state)


def require_control(request: Request, state: ServerState = Depends(get_state)) -> None:
    if state.api_key is not None:
        _check_key(request, state)
        return
    reason = control_refusal(state.host, state.api_key)
    if reason is not None:
        raise APIError(403, reason + "; restart with --api-key or bind 127.0.0.1", code="control_disabled")
