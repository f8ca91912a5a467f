"""schemathesis hooks for benchmarks.robustness' fuzz run (``SCHEMATHESIS_HOOKS=benchmarks.fuzz_hooks``).

``POST /trace/step`` with ``wait: true`` answers once the engine is held again or after its
``timeout`` (up to 300 s, as documented). On an idle engine that is the whole timeout, so a
fuzzed 224 s wait is correct behaviour that would only stall the run: such waits are capped
at 1 s. Every other field stays the fuzzer's."""
from __future__ import annotations

import schemathesis

MAX_WAIT = 1.0


@schemathesis.hook
def before_call(context, case, kwargs) -> None:
    body = case.body
    if case.path == "/trace/step" and isinstance(body, dict) and body.get("wait") is True:
        timeout = body.get("timeout")
        if isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > MAX_WAIT:
            body["timeout"] = MAX_WAIT
