"""The same requests to both servers: status codes, JSON field sets, greedy texts, and the `vllm:` metrics.

Field sets are compared as paths (``choices[].logprobs.top_logprobs``): every path vLLM answers must be in
ours, unless EXPLAINED says why not; paths only ours has are listed (trace data and the like). A stream's
paths are the union over its chunks. Every ``vllm:`` metric family we export must exist in vLLM's /metrics
with the same type and label names.
"""
from __future__ import annotations

import json

from benchmarks.parity.servers import get, post

# Differences that are by design, each with its reason (the harness fails on any other).
EXPLAINED = {
    "usage.prompt_tokens_details": "vLLM's usage lists cached prompt tokens only with --enable-prompt-tokens-"
                                   "details; it answers null otherwise, and we leave the field out",
    "system_fingerprint": "vLLM sends null; we leave it out",
    "service_tier": "vLLM sends null; we leave it out",
    "kv_transfer_params": "vLLM sends null without a KV connector; we leave it out",
    "prompt_logprobs": "vLLM sends null unless prompt_logprobs is asked (a vLLM extension); we leave it out",
    "prompt_token_ids": "vLLM sends null unless return_token_ids is asked; we leave it out",
    "choices[].prompt_logprobs": "echo with logprobs: vLLM also returns its own prompt_logprobs list (a vLLM "
                                 "extension) beside the OpenAI logprobs both send; ours only the latter",
    "data[].permission": "vLLM lists OpenAI's legacy model permissions; OpenAI's API no longer has them",
    "error.code": "vLLM puts the HTTP status in error.code; ours leaves it null, as OpenAI does for these",
    "error.param": "vLLM names a param for some validation errors where ours gives none",
}
# Texts that may differ by design, with the reason.
TEXT_EXPLAINED = {
    "chat json_object": "grammar-constrained: vLLM's xgrammar allows any whitespace between JSON tokens, ours "
                        "compact JSON (', ' and ': '; see engine/structured_output/backend_xgrammar.py)",
    "chat json_schema": "as for json_object",
}
# vLLM registers these only when speculative decoding is configured; we register them always (zero).
METRICS_EXPLAINED = ("vllm:spec_decode_",)


def requests(model: str) -> list[tuple[str, str, object]]:
    """(name, path, body): what both servers get, in this order."""
    greedy = dict(model=model, temperature=0, max_tokens=8)
    chat = [{"role": "user", "content": "Once upon a time"}]
    return [
        ("completion", "/v1/completions", dict(greedy, prompt="Once upon a time")),
        ("completion two prompts", "/v1/completions", dict(greedy, prompt=["The cat", "A dog"])),
        ("completion echo logprobs", "/v1/completions", dict(greedy, prompt="The little cat", echo=True,
                                                             logprobs=2, max_tokens=4)),
        ("completion stop", "/v1/completions", dict(greedy, prompt="Once upon a time", stop=[" the"],
                                                    max_tokens=24)),
        ("completion n=2 seeded", "/v1/completions", dict(model=model, prompt="Hello", n=2, seed=3,
                                                          temperature=0.8, max_tokens=6)),
        ("completion stream", "/v1/completions", dict(greedy, prompt="Once upon a time", stream=True,
                                                      stream_options={"include_usage": True})),
        ("chat", "/v1/chat/completions", dict(greedy, messages=chat)),
        ("chat logprobs", "/v1/chat/completions", dict(greedy, messages=chat, logprobs=True, top_logprobs=2)),
        ("chat stream", "/v1/chat/completions", dict(greedy, messages=chat, stream=True)),
        ("chat json_object", "/v1/chat/completions", dict(greedy, messages=chat, max_tokens=12,
                                                          response_format={"type": "json_object"})),
        ("chat json_schema", "/v1/chat/completions", dict(greedy, messages=chat, max_tokens=24, response_format={
            "type": "json_schema", "json_schema": {"name": "a", "schema": {
                "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}})),
        ("models", "/v1/models", None),
        ("error: unknown model", "/v1/completions", dict(greedy, model="no-such-model", prompt="Hi")),
        ("error: negative max_tokens", "/v1/completions", dict(greedy, prompt="Hi", max_tokens=-1)),
        ("error: prompt too long", "/v1/completions", dict(greedy, prompt="the " * 600)),
        ("error: bad JSON", "/v1/completions", "{not json"),
        ("error: no messages", "/v1/chat/completions", dict(model=model)),
    ]


def paths(value, prefix: str = "") -> set[str]:
    """Every key path in a JSON value (list items as []); null-valued keys are left out."""
    out: set[str] = set()
    if isinstance(value, dict):
        for k, v in value.items():
            if v is None:
                continue
            k = "<id>" if k.lstrip("-").isdigit() else k  # token ids as keys (prompt_logprobs)
            p = f"{prefix}.{k}" if prefix else k
            out |= {p} | paths(v, p)
    elif isinstance(value, list):
        for v in value:
            out |= paths(v, prefix + "[]")
    return out


def parse(text: str) -> tuple[object, bool]:
    """A JSON body, or an SSE stream as the list of its data objects (and whether [DONE] ended it)."""
    if text.startswith("data:"):
        events = [line[5:].strip() for line in text.splitlines() if line.startswith("data:")]
        return [json.loads(e) for e in events if e != "[DONE]"], bool(events) and events[-1] == "[DONE]"
    try:
        return json.loads(text), False
    except ValueError:
        return text, False


def texts(body) -> list:
    """The choices' texts (a stream's joined), for the greedy comparison."""
    chunks = body if isinstance(body, list) else [body] if isinstance(body, dict) else []
    out: dict[int, str] = {}
    for c in chunks:
        for ch in c.get("choices") or []:
            piece = ch.get("text") or (ch.get("message") or ch.get("delta") or {}).get("content") or ""
            out[ch["index"]] = out.get(ch["index"], "") + piece
    return [out[i] for i in sorted(out)]


def explained(path: str) -> str | None:
    """The reason for a path (or for one of its prefixes, or for its top key) being vLLM's only."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        prefix = ".".join(parts[:i])
        why = (EXPLAINED.get(prefix) or EXPLAINED.get(prefix.removesuffix("[]"))
               or EXPLAINED.get(parts[i - 1].removesuffix("[]")))
        if why:
            return why
    return None


def compare_requests(vllm_url: str, ours_url: str, model: str) -> tuple[list[str], list[str]]:
    """(problems, notes): problems are unexplained differences; notes what differs by design."""
    problems, notes = [], []
    for name, path, body in requests(model):
        answers = [get(url + path) if body is None else post(url + path, body) for url in (vllm_url, ours_url)]
        (vs, vtext), (os_, otext) = answers
        (vbody, vdone), (obody, odone) = parse(vtext), parse(otext)
        if (vs >= 400) != (os_ >= 400) or (vs >= 400 and vs != os_):
            problems.append(f"{name}: status vLLM {vs}, ours {os_} ({vtext[:120]!r} / {otext[:120]!r})")
            continue
        if vdone != odone:
            problems.append(f"{name}: [DONE] vLLM {vdone}, ours {odone}")
        vpaths, opaths = paths(vbody), paths(obody)
        for p in sorted(vpaths - opaths):
            why = explained(p)
            (notes if why else problems).append(f"{name}: vLLM has {p}, ours not" + (f" ({why})" if why else ""))
        extra = sorted(opaths - vpaths)
        if extra:
            notes.append(f"{name}: ours adds {', '.join(extra)}")
        if name.startswith(("completion", "chat")) and "seeded" not in name and vs < 400:
            vt, ot = texts(vbody), texts(obody)
            if vt != ot:
                why = TEXT_EXPLAINED.get(name)
                (notes if why else problems).append(f"{name}: greedy texts differ: vLLM {vt!r}, ours {ot!r}"
                                                    + (f" ({why})" if why else ""))
    return problems, notes


def metric_families(text: str) -> dict[str, tuple[str, frozenset]]:
    """name -> (type, label names) from Prometheus text; counters' samples end in _total."""
    types, labels = {}, {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(maxsplit=3)
            types[name] = kind
        elif line and not line.startswith("#"):
            sample = line.split("{", 1)[0].split(" ", 1)[0]
            names = {kv.split("=", 1)[0].strip() for kv in line.split("{", 1)[1].rsplit("}", 1)[0].split(",")
                     if "=" in kv} if "{" in line else set()
            family = next((f for f in (sample, sample.removesuffix("_total"), sample.rsplit("_", 1)[0])
                           if f in types), sample)
            labels.setdefault(family, set()).update(names - {"le", "quantile"})
    return {n: (t, frozenset(labels.get(n, ()))) for n, t in types.items()}


def compare_metrics(vllm_url: str, ours_url: str) -> tuple[list[str], list[str]]:
    theirs = metric_families(get(vllm_url + "/metrics")[1])
    mine = metric_families(get(ours_url + "/metrics")[1])
    problems, notes = [], []
    for name, (kind, labels) in sorted(mine.items()):
        if not name.startswith("vllm:"):
            continue
        if name not in theirs and name.startswith(METRICS_EXPLAINED):
            notes.append(f"metric {name}: vLLM registers it only with speculative decoding configured")
        elif name not in theirs:
            problems.append(f"metric {name} ({kind}): not in vLLM's /metrics")
        elif theirs[name][0] != kind:
            problems.append(f"metric {name}: type {kind}, vLLM's {theirs[name][0]}")
        elif labels != theirs[name][1]:
            problems.append(f"metric {name}: labels {sorted(labels)}, vLLM's {sorted(theirs[name][1])}")
    ours_vllm = {n for n in mine if n.startswith("vllm:")}
    notes.append(f"{len(ours_vllm)} vllm: metrics exported, all checked; vLLM has {len(theirs)} families, "
                 f"{len([n for n in theirs if n.startswith('vllm:') and n not in mine])} vllm: ones we do not export")
    return problems, notes
