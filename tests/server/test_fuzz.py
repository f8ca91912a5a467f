"""Schema-based fuzzing: schemathesis generates requests from /openapi.json; no input may
produce a 5xx, and every response must match what the document says (status, content type,
headers, body schema). Bounded examples per operation keep it to a few seconds;
benchmarks/robustness.py runs 2,000+ cases against a traced `serve`."""
from __future__ import annotations

import pytest

# hundreds of generated requests per server mode (76 s on 2 cores): make test-slow; test_errors.py's bad input and
# test_reliability.py's malformed requests keep the server's validation in make test
pytestmark = pytest.mark.slow
schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
          response_schema_conformance]


@pytest.fixture
def api_schema(live):
    return schemathesis.openapi.from_url(live.url + "/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")
MAX_TOKENS = 4
MAX_N = 4


@schema.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_server_errors(case, live):
    # Short generations keep the fuzz fast (an unset max_tokens fills the whole context); the
    # fuzzer still controls every other field, and invalid lengths (<= 0) pass through.
    if isinstance(case.body, dict) and case.path.startswith("/v1/"):
        for key in ("max_tokens", "max_completion_tokens"):
            value = case.body.get(key)
            if not isinstance(value, int) or value > MAX_TOKENS:
                case.body[key] = MAX_TOKENS
        # likewise the fan-out: n=9449 (valid: vLLM allows 16,384) is 9,449 requests of work and trace events,
        # minutes on two cores and gigabytes of trace in this process; invalid values (<= 0) pass through
        if isinstance(case.body.get("n"), int) and case.body["n"] > MAX_N:
            case.body["n"] = MAX_N
    case.call_and_validate(base_url=live.url, checks=CHECKS, timeout=60)
