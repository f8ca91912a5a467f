"""The KV that moved: a request's blocks saved, sent, received and loaded by a KV connector (the request
detail's "KV transfer" section), and the host-memory tier's line in the KV-cache panel.

The request's headline says where its prompt's KV came from when it was admitted, from the engine's
own counts: the tokens its first prefill chunk started at were found in this instance's prefix cache
(its lookup's hit) or delivered by the connector (the rest), and the chunks computed what was left. So
on a decode instance: "prompt 480 tokens: 479 received from engine 3f2a in 6.0 ms (1.9 MiB), 1
computed"; the bytes and seconds are the connector's kv_transfer events' (all layers).
"""
from __future__ import annotations

from rich.text import Text

from engine.trace_names import KV_LOAD, KV_RECV
from tracer.state import RequestView, TraceState, offload_tier, prompt_sources
from tracer.tui.fmt import fmt_bytes, plural

MAX_BLOCK_IDS = 16  # block ids listed per transfer; the rest are counted
DELIVERING = (KV_LOAD, KV_RECV)
# where a connector's loads come from
LOADED_FROM = {"OffloadingConnector": "loaded from host memory", "ExampleConnector": "loaded from shared storage"}


def fmt_ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def delivered_by(r: RequestView, step: int) -> list[dict]:
    """Its loads and receives up to its first prefill (in `step`): what the tokens delivered then came in (a
    receive comes in a step before, while it waits for it; a load in that step's forward pass)."""
    return [t for t in r.kv_transfers if t["kind"] in DELIVERING and (t["step"] is None or t["step"] <= step)]


def how_delivered(r: RequestView, moves: list[dict]) -> str:
    """'received from engine 3f2a', 'loaded from host memory', ..."""
    last = moves[-1]
    if last["kind"] == KV_RECV:
        engine = (r.kv_transfer_params or {}).get("remote_engine_id")
        return f"received from engine {engine}" if engine else "received from another instance"
    return LOADED_FROM.get(last["connector"], f"loaded by {last['connector']}")


def prompt_line(r: RequestView) -> str | None:
    """'prompt 480 tokens: 479 received from engine 3f2a in 6.0 ms (1.9 MiB), 1 computed'; None before its
    first prefill."""
    src = prompt_sources(r)
    if src is None:
        return None
    parts = [f"{src['hit']} from the prefix cache"] if src["hit"] else []
    if src["delivered"]:
        moves = delivered_by(r, src["step"])
        if moves:
            parts.append(f"{src['delivered']} {how_delivered(r, moves)} in "
                         f"{fmt_ms(sum(t['seconds'] for t in moves))} ({fmt_bytes(sum(t['bytes'] for t in moves))})")
        else:  # a load runs in the step's forward pass: its event comes at the step's end
            parts.append(f"{src['delivered']} delivered by the KV connector (loading in this step)")
    parts.append(f"{src['computed']} computed")
    return f"prompt {r.num_prompt_tokens} tokens: " + ", ".join(parts)


def params_line(params: dict | None) -> str | None:
    """What its kv_transfer_params asked for (disaggregated prefill), in words."""
    if not params:
        return None
    if params.get("remote_request_id"):
        where = f" at {params['remote_host']}:{params['remote_port']}" if params.get("remote_host") else ""
        return (f"decode of request {params['remote_request_id']}, prefilled by engine "
                f"{params.get('remote_engine_id') or '?'}{where}: its "
                f"{plural(len(params.get('remote_block_ids') or ()), 'block')} pulled from there")
    if params.get("do_remote_decode"):
        return "prefill for a decode instance (do_remote_decode): its blocks are kept until that instance pulls them"
    return None


def transfer_line(t: dict) -> str:
    """' recv step 3    1 block   64.0 KiB in  5.8 ms P2pZmqConnector: 1' (its block ids last: the detail may
    sit beside the Requests list, 70 columns wide)."""
    ids = t["block_ids"]
    shown = " ".join(map(str, ids[:MAX_BLOCK_IDS])) + (f" … +{len(ids) - MAX_BLOCK_IDS}" if len(ids) > MAX_BLOCK_IDS
                                                        else "")
    step = t["step"] if t["step"] is not None else "-"
    return (f" {t['kind']:<4} step {step:<4} {plural(len(ids), 'block'):<9} {fmt_bytes(t['bytes']):>9} in "
            f"{fmt_ms(t['seconds']):>7} {t['connector'] or ''}: {shown}")


def kv_transfer_section(r: RequestView) -> Text | None:
    """The request detail's KV-transfer lines, or None for a request no connector touched."""
    src = prompt_sources(r)
    if not (r.kv_transfers or params_line(r.kv_transfer_params) or (src and src["delivered"])):
        return None
    t = Text()
    for line in (params_line(r.kv_transfer_params), prompt_line(r)):
        if line:
            t.append(line + "\n", "cyan")
    if r.kv_transfers:
        t.append("\n".join(transfer_line(x) for x in r.kv_transfers))
    else:
        t.append("no blocks moved yet", "dim")
    t.rstrip()
    return t


def offload_line(s: TraceState) -> str:
    """The host-memory tier (--kv-offloading-size): its size, the blocks it holds, and since the start the
    blocks stored there, the prompt tokens found there and the blocks loaded back ('' without a tier)."""
    tier = offload_tier(s)
    if not tier:
        return ""
    return (f"\nhost-memory tier (OffloadingConnector): {fmt_bytes(tier['cpu_bytes'])} = "
            f"{plural(tier['num_cpu_blocks'], 'block')}, {tier['num_held_blocks']} held · "
            f"{tier['num_stored_blocks']} stored · {plural(tier['num_hit_tokens'], 'token')} hit, "
            f"{tier['num_loaded_blocks']} loaded back")
