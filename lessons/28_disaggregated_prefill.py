"""Lesson 28: disaggregated prefill — one instance computes the prompt, another generates, the KV blocks move."""
import pathlib
import random
import socket
import statistics
import sys
import threading
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # `python lessons/NN_x.py` from a checkout

from engine import SamplingParams
from engine.request import RequestStatus
from engine.trace_names import BATCH, KV_RECV, KV_SEND, KV_TRANSFER, MODEL_RUNNER
from lessons.cli import main
from lessons.framework import events_of, greedy, queue_request, table

TITLE = "Disaggregated prefill"
SUMMARY = ("A prefill instance and a decode instance joined by a KV connector (P2pZmqConnector, vLLM's NixlConnector "
           "protocol): the kv_transfer_params between them, the request waiting for its remote KV, the blocks and "
           "bytes that cross the wire, why the decode instance still computes one token, and TTFT and ITL of a mixed "
           "load with and without disaggregation, measured.")
BLOCK = 16
PROMPT = ("Disaggregated serving: one instance computes the prompt, another generates the answer, and the prompt's "
          "keys and values travel from the first to the second.")
LENGTHS = [16, 17, 40, 100]  # prompt tokens: a block less one delivered, a whole block, several
SHORT, SHORT_OUT, NUM_SHORT = 8, 24, 4  # the mixed load: short prompts decoding ...
LONG, LONG_OUT, NUM_LONG = 400, 4, 2  # ... when long prompts arrive
ARRIVE_AT, REPS = 4, 3  # the long prompts arrive at the short requests' 4th step; each setup runs REPS times


def run(lesson) -> None:
    lesson.intro(
        "A prompt's prefill is one big compute-bound step; a decode step is small and memory-bound. On one "
        "instance a long prompt's prefill runs in the same step as everyone else's next token, so every "
        "stream stalls while it runs. **Disaggregated prefill** gives the two phases instances of their own: "
        "the proxy (`vllm-trace proxy`, vLLM's toy proxy) sends each request to a **prefill instance** with "
        "`max_tokens=1`, which computes the prompt and keeps its KV blocks, then to a **decode instance**, "
        "which pulls those blocks over the network and generates. This lesson runs both instances in this "
        "process with the `P2pZmqConnector` (vLLM's `NixlConnector` protocol, with ZMQ for NIXL's RDMA), "
        "follows one request across, reads what crossed the wire from the trace, and measures a mixed load "
        "both ways.")
    prefill, p_session = lesson.engine(block_size=BLOCK, num_kv_blocks=256, kv_transfer_config=_kv("kv_producer"))
    decode, d_session = lesson.engine(block_size=BLOCK, num_kv_blocks=256, kv_transfer_config=_kv("kv_consumer"))
    colocated, c_session = lesson.engine(block_size=BLOCK, num_kv_blocks=256)  # one instance doing both
    try:
        one_request(lesson, prefill, decode, colocated)
        what_crosses_the_wire(lesson, prefill, p_session, decode, d_session)
        mixed_load(lesson, prefill, decode, d_session, colocated, c_session)
    finally:
        prefill.shutdown()
        decode.shutdown()
    lesson.done(
        "The prefill instance computes the prompt, finishes the request at its first token and keeps its blocks; "
        "its answer's `kv_transfer_params` say where they are. The decode instance allocates blocks for the "
        "prompt, waits (`WAITING_FOR_REMOTE_KVS`) while its worker pulls every layer's K and V of those blocks, "
        "then computes only what was not delivered: the prompt's last token, whose logits give the first output "
        "token. The wire carries blocks, not tokens: layers × 2 × block size × KV heads × head size × bytes per "
        "value each. Disaggregation keeps long prefills out of the decode instance's steps, so its streams' "
        "inter-token latency no longer jumps when a long prompt arrives; the price is the hop, which the long prompts' "
        "TTFT pays, and a second instance's hardware: instances that share the same cores slow each other down.")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kv(role: str) -> dict:
    extra = {"kv_port": _free_port()} if role == "kv_producer" else {}
    return {"kv_connector": "P2pZmqConnector", "kv_role": role, "kv_connector_extra_config": extra}


def _core(llm):
    return llm.llm_engine.engine_core.engine_core


def _remote_decode(max_tokens: int = 1) -> SamplingParams:
    """What the proxy asks of the prefill instance."""
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                          extra_args={"kv_transfer_params": {"do_remote_decode": True}})


def _then_decode(params: dict, max_tokens: int) -> SamplingParams:
    """What the proxy asks of the decode instance: the request, with the prefill instance's answer."""
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                          extra_args={"kv_transfer_params": params})


def _free_sent_blocks(llm, timeout_s: float = 60.0) -> bool:
    """Step the prefill instance until it has freed the blocks it kept for pulls (they are freed at the
    step after the pull is answered); True once every block is free."""
    core, end = _core(llm), time.monotonic() + timeout_s
    while core.scheduler.has_unfinished_requests() and time.monotonic() < end:
        core.step_fn()
    core.step_fn()  # one more: the send's trace event, recorded after the pull was answered, is published
    stats = core.stats()
    return stats.num_free_blocks == stats.num_total_blocks


def _computed(events, rid: str) -> list[int]:
    """The tokens each forward pass computed for the request (its rows of the model runner's batches)."""
    return [a["query_start_loc"][i + 1] - a["query_start_loc"][i] for a in events
            for i, r in enumerate(a["request_ids"]) if r == rid]


def _batches(session, since: int = 0) -> list[dict]:
    return [e.attrs for e in events_of(session) if (e.layer, e.name) == (MODEL_RUNNER, BATCH) and e.seq >= since]


def one_request(lesson, prefill, decode, colocated) -> None:
    pre = prefill.generate(PROMPT, _remote_decode(), use_tqdm=False)[0]
    params = pre.kv_transfer_params
    n = len(pre.prompt_token_ids)
    lesson.show(table(["key", "value"], [[k, v] for k, v in params.items()],
                      title=f"the prefill instance's answer: kv_transfer_params of request {pre.request_id}"))
    stats = _core(prefill).stats()
    lesson.check(params["do_remote_prefill"] and len(params["remote_block_ids"]) == -(-n // BLOCK)
                 and stats.num_total_blocks - stats.num_free_blocks == len(params["remote_block_ids"]),
                 f"the prefill instance finished the request at max_tokens=1 but kept its {-(-n // BLOCK)} blocks "
                 f"(ceil({n} / {BLOCK})) for the decode instance, and said where: its host, port and block ids")
    lesson.pause()

    req = queue_request(decode.llm_engine, "decode-me", PROMPT, _then_decode(params, 8))
    decode.llm_engine.step()  # admitted: blocks allocated, the pull started on the worker's thread
    lesson.show(table(["", ""], [["status", req.status.value], ["blocks allocated", " ".join(map(str, req.block_ids))],
                                 ["tokens computed", req.num_computed_tokens]],
                      title="the decode instance after one step"))
    lesson.check(req.status is RequestStatus.WAITING_FOR_REMOTE_KVS and len(req.block_ids) == -(-n // BLOCK)
                 and req.num_computed_tokens == 0,
                 "the decode instance allocated the prompt's blocks and set the request aside as "
                 "WAITING_FOR_REMOTE_KVS: it is not scheduled until its worker reports the blocks received")
    outs = {}
    while decode.llm_engine.has_unfinished_requests():
        for o in decode.llm_engine.step():
            outs[o.request_id] = o
    want = colocated.generate(PROMPT, greedy(8), use_tqdm=False)[0].outputs[0].token_ids
    lesson.check(outs["decode-me"].outputs[0].token_ids == want,
                 "its greedy output is the one a single instance gives, computing the whole prompt itself")
    lesson.check(_free_sent_blocks(prefill), "once the blocks were pulled, the prefill instance freed them")
    lesson.pause()


def what_crosses_the_wire(lesson, prefill, p_session, decode, d_session) -> None:
    k, _ = next(iter(_core(decode).model_runner.kv_connector.kv_caches.values()))
    layers = len(_core(decode).model_runner.kv_connector.kv_caches)
    per_block = layers * 2 * k[0].numel() * k.element_size()
    rng = random.Random(28)
    rows, ok_bytes, ok_computed = [], True, True
    for n in LENGTHS:
        prompt = [rng.randrange(256) for _ in range(n)]
        since = d_session.bus.next_seq
        pre = prefill.generate([{"prompt_token_ids": prompt}], _remote_decode(), use_tqdm=False)[0]
        out = decode.generate([{"prompt_token_ids": prompt}], _then_decode(pre.kv_transfer_params, 2),
                              use_tqdm=False)[0]
        lesson.check(_free_sent_blocks(prefill), f"the prefill instance freed the {n}-token prompt's blocks")
        recv = next(e.attrs for e in events_of(d_session) if e.seq >= since and e.layer == KV_TRANSFER
                    and e.name == KV_RECV and e.request_id == out.request_id)
        sent = next(e.attrs for e in events_of(p_session) if e.layer == KV_TRANSFER and e.name == KV_SEND
                    and e.request_id == pre.request_id)
        delivered = out.num_cached_tokens
        computed = _computed(_batches(d_session, since), out.request_id)
        ok_bytes &= recv["bytes"] == sent["bytes"] == len(recv["block_ids"]) * per_block
        ok_bytes &= len(recv["block_ids"]) == -(-(n - 1) // BLOCK)
        ok_computed &= delivered == n - 1 and computed[0] == n - delivered >= 1
        rows.append([n, len(recv["block_ids"]), f"{recv['bytes']:,}", f"{recv['seconds'] * 1000:.1f}", delivered,
                     computed[0]])
    lesson.show(table(["prompt tokens", "blocks pulled", "bytes", "pull ms", "tokens delivered",
                       "computed by the decode instance"], rows,
                      title="what crossed the wire, from the kv_transfer events (recv here, send there)"))
    lesson.say(f"A block of this model holds {layers} layers × K and V × {BLOCK} tokens × "
               f"{k.shape[2]} KV heads × {k.shape[3]} values × {k.element_size()} bytes = {per_block:,} bytes. "
               "The decode instance asks for the blocks that hold the prompt's tokens but the last; a block half "
               "full is sent whole.")
    lesson.check(ok_bytes, f"every pull moved ceil((prompt tokens - 1) / {BLOCK}) blocks of {per_block:,} bytes, "
                           "and the prefill instance's send event counted the same bytes")
    lesson.check(ok_computed,
                 "for every prompt the decode instance's forward pass computed exactly the tokens not delivered: "
                 "prompt tokens - (prompt tokens - 1) = 1")
    lesson.say("Why not deliver the last token too? The first output token is sampled from the logits of the "
               "prompt's last position, and logits are not KV: the prefill instance sampled one, but the proxy "
               "throws its answer away. So the decode instance runs the last prompt token through every layer "
               "(reading the pulled KV of the ones before it), writes its K and V, and samples from its logits: "
               "one token of prefill, the same output token. In vLLM 0.33 the `NixlConnector` offers the whole prompt "
               "and the scheduler, once it has arrived, counts all but its last token as computed "
               "(`_update_waiting_for_remote_kv`); the `P2pZmqConnector` asks for all but the last from the start, "
               "so it pulls a block less when the last one would hold only that token. Either way one token is "
               "computed.")
    lesson.pause()


def _run_load(decode_llm, shorts, longs, prefill=None) -> tuple[dict, dict, float]:
    """The short requests decoding on decode_llm; at their ARRIVE_AT-th step the long ones arrive: on this
    engine (colocated), or first on the prefill instance, on a thread of its own, then here with its answer.
    Returns (request id -> its token times, request id -> its output tokens, the long ones' arrival time)."""
    eng, tag = decode_llm.llm_engine, f"{time.monotonic_ns()}"
    for i, p in enumerate(shorts):
        queue_request(eng, f"short{i}-{tag}", {"prompt_token_ids": p}, greedy(SHORT_OUT))
    times: dict[str, list[float]] = {}
    tokens: dict[str, list[int]] = {}
    answered: list = []
    worker, arrived, queued, step = None, 0.0, False, 0
    while eng.has_unfinished_requests() or not queued:
        if step == ARRIVE_AT and not arrived:
            arrived = time.perf_counter()
            if prefill is None:
                for i, p in enumerate(longs):
                    queue_request(eng, f"long{i}-{tag}", {"prompt_token_ids": p}, greedy(LONG_OUT))
                queued = True
            else:
                worker = threading.Thread(target=lambda: answered.extend(prefill.generate(
                    [{"prompt_token_ids": p} for p in longs], _remote_decode(), use_tqdm=False)), name="prefill")
                worker.start()
        if worker is not None and not queued and not worker.is_alive():
            for i, (p, pre) in enumerate(zip(longs, answered)):
                queue_request(eng, f"long{i}-{tag}", {"prompt_token_ids": p},
                              _then_decode(pre.kv_transfer_params, LONG_OUT))
            queued = True
        if not eng.has_unfinished_requests():  # only the prefill instance is busy
            worker.join(0.001)
            continue
        for o in eng.step():
            now = time.perf_counter()
            new = len(o.outputs[0].token_ids) - len(tokens.get(o.request_id, ()))
            times.setdefault(o.request_id, []).extend([now] * new)
            tokens[o.request_id] = list(o.outputs[0].token_ids)
        step += 1
    return times, tokens, arrived


def mixed_load(lesson, prefill, decode, d_session, colocated, c_session) -> None:
    lesson.say(f"Now a mixed load: {NUM_SHORT} short requests ({SHORT} prompt tokens, {SHORT_OUT} to generate) are "
               f"decoding when {NUM_LONG} long prompts ({LONG} tokens) arrive at once. Colocated, one instance does "
               "everything; disaggregated, the long prompts go to the prefill instance first (on a thread of this "
               "process, as another machine would run it meanwhile) and the decode instance pulls their KV. "
               f"Each setup runs {REPS} times, interleaved.")
    rng = random.Random(280)
    runs: dict[str, list] = {"colocated": [], "disaggregated": []}
    outputs: dict[str, list] = {"colocated": [], "disaggregated": []}
    c_since, d_since = c_session.bus.next_seq, d_session.bus.next_seq
    for _ in range(REPS):
        shorts = [[rng.randrange(256) for _ in range(SHORT)] for _ in range(NUM_SHORT)]
        longs = [[rng.randrange(256) for _ in range(LONG)] for _ in range(NUM_LONG)]
        for name, llm, pre in (("colocated", colocated, None), ("disaggregated", decode, prefill)):
            times, tokens, arrived = _run_load(llm, shorts, longs, pre)
            runs[name].append(_latencies(times, arrived))
            outputs[name].append([tokens[r] for r in sorted(tokens)])
        lesson.check(_free_sent_blocks(prefill), "the prefill instance freed the long prompts' blocks once pulled")
    rows = []
    for name, rs in runs.items():
        rows.append([name, f"{statistics.median(r['ttft'] for r in rs):.0f}",
                     f"{statistics.median(r['itl_median'] for r in rs):.1f}",
                     f"{statistics.median(r['itl_max'] for r in rs):.1f}"])
    lesson.show(table(["", "long prompts' TTFT (ms)", "short streams' ITL, median (ms)",
                       "short streams' ITL, max (ms)"], rows,
                      title=f"medians of {REPS} runs on this machine (both instances share its cores)"))
    lesson.check(outputs["colocated"] == outputs["disaggregated"],
                 "every request got the same greedy tokens colocated and disaggregated")
    c_long = [c for a in _batches(c_session, c_since) for i, c in enumerate(_rows(a)) if
              a["request_ids"][i].startswith("long") and c == LONG]
    c_mixed = [a for a in _batches(c_session, c_since) if any(r.startswith("long") for r in a["request_ids"])
               and any(r.startswith("short") for r in a["request_ids"])]
    lesson.check(len(c_long) == REPS * NUM_LONG and c_mixed,
                 f"colocated, each long prompt's {LONG} tokens were computed in one step, beside the short "
                 "requests' next tokens: every short stream waited for that step")
    d_long = [c for a in _batches(d_session, d_since) for i, c in enumerate(_rows(a))
              if a["request_ids"][i].startswith("long")]
    lesson.check(d_long and max(d_long) == 1,
                 "disaggregated, the decode instance never ran a long prefill: each long request's forward passes "
                 "there computed one token (its prompt's last, then one per output token)")
    c, d = (statistics.median(r["itl_max"] for r in runs[k]) for k in ("colocated", "disaggregated"))
    cm, dm = (statistics.median(r["itl_median"] for r in runs[k]) for k in ("colocated", "disaggregated"))
    text = (f"Here the short streams' longest gap was {c:.0f} ms colocated and {d:.0f} ms disaggregated"
            + (": the long prefills ran elsewhere. " if d < c else ": no gain. ")
            + f"Their median gap was {cm:.0f} ms colocated and {dm:.0f} ms disaggregated")
    if dm > cm:
        text += ("; both instances share this machine's cores, so the prefill instance's work slows the decode "
                 "instance's steps beside it, which on two machines (or two GPUs) it would not")
    lesson.say(text + ". The long prompts' TTFT pays for the hop: the prefill instance's step, the pull, and the "
                      "decode instance's one-token step.")
    lesson.pause()


def _rows(batch: dict) -> list[int]:
    q = batch["query_start_loc"]
    return [q[i + 1] - q[i] for i in range(len(batch["request_ids"]))]


def _latencies(times: dict, arrived: float) -> dict:
    longs = [ts[0] - arrived for rid, ts in times.items() if rid.startswith("long")]
    gaps = [b - a for rid, ts in times.items() if rid.startswith("short") for a, b in zip(ts, ts[1:])]
    return dict(ttft=statistics.median(longs) * 1000, itl_median=statistics.median(gaps) * 1000,
                itl_max=max(gaps) * 1000)


if __name__ == "__main__":
    raise SystemExit(main(globals()))
