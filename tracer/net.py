"""How the command line and the TUI reach a server over HTTP."""
from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit


def trust_env(url: str) -> bool:
    """Whether an HTTP client of url should take its proxy (and certificates) from the environment:
    not for this machine. With HTTP_PROXY set, curl (which ignores that upper-case variable) reached
    a server on 127.0.0.1 while attach, send and bench (httpx honours it) failed with "ConnectError:
    All connection attempts failed": the proxy was what they could not reach."""
    host = urlsplit(url).hostname or ""
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host != "localhost"
