"""KV connectors: what a transfer costs against computing the same tokens, in one process.

    python -m benchmarks.kv_transfer [--model tiny-gpt2] [--lengths 64,256,480] [--reps 5]

  p2p        a prefill engine and a decode engine (P2pZmqConnector over loopback ZMQ): per prompt
             length, the KV bytes a request's pull moves and the pull's seconds (the decode side's
             kv_transfer recv events), and the decode engine's first-token time with the pull
             against a plain engine computing the whole prompt;
  offload    --kv-offloading-size: a prompt's prefix evicted from the device (reset_prefix_cache)
             and found in host memory, loaded back layer by layer, against the same prompt computed
             cold (first-token time of a max_tokens=1 request, and the load's seconds).
Medians of --reps. Torch runs single-threaded (--threads), as the other CPU benchmarks.
"""
from __future__ import annotations

import argparse
import random
import socket
import statistics
import time

import torch

from engine import LLM, SamplingParams
from engine.hooks import Hooks
from engine.trace_names import KV_LOAD, KV_RECV, KV_TRANSFER

ONE = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _engine(model: str, events: list, **kwargs) -> LLM:
    hooks = Hooks()
    hooks.subscribe(lambda layer, name, kind, rid, step, attrs: events.append((name, attrs))
                    if layer == KV_TRANSFER else None)
    return LLM(model, hooks=hooks, num_kv_blocks=256, **kwargs)


def _timed(llm: LLM, prompt: list[int], params: SamplingParams = ONE) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    return time.perf_counter() - t0, out


def p2p(model: str, lengths: list[int], reps: int) -> None:
    kv = {"kv_connector": "P2pZmqConnector"}
    events: list = []
    prefill = _engine(model, [], kv_transfer_config={**kv, "kv_role": "kv_producer",
                                                     "kv_connector_extra_config": {"kv_port": _free_port()}})
    decode = _engine(model, events, kv_transfer_config={**kv, "kv_role": "kv_consumer"}, enable_prefix_caching=False)
    plain = LLM(model, num_kv_blocks=256, enable_prefix_caching=False)
    remote = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True,
                            extra_args={"kv_transfer_params": {"do_remote_decode": True}})
    rng = random.Random(0)
    print("p2p: prompt tokens | KV bytes | pull s | decode first token s (pull + 1 token) | plain first token s")
    for n in lengths:
        pulls, with_pull, without = [], [], []
        for _ in range(reps):
            prompt = [rng.randrange(256) for _ in range(n)]
            params = _timed(prefill, prompt, remote)[1].kv_transfer_params
            events.clear()
            with_pull.append(_timed(decode, prompt, SamplingParams(
                temperature=0.0, max_tokens=1, ignore_eos=True, extra_args={"kv_transfer_params": params}))[0])
            pulls += [a for name, a in events if name == KV_RECV]
            without.append(_timed(plain, prompt)[0])
            core = prefill.llm_engine.engine_core.engine_core
            while core.scheduler.has_unfinished_requests():  # the pulled blocks freed
                core.step_fn()
        print(f"  {n:5d} | {pulls[0]['bytes']:9,d} | {statistics.median(a['seconds'] for a in pulls):.4f} | "
              f"{statistics.median(with_pull):.4f} | {statistics.median(without):.4f}")
    prefill.shutdown()
    decode.shutdown()


def offload(model: str, lengths: list[int], reps: int) -> None:
    events: list = []
    llm = _engine(model, events, kv_offloading_size=0.25)
    cold = LLM(model, num_kv_blocks=256, enable_prefix_caching=False)
    rng = random.Random(1)
    print("offload: prompt tokens | KV bytes loaded | load s | first token s from host | first token s cold")
    for n in lengths:
        loads, hit, computed = [], [], []
        for _ in range(reps):
            prompt = [rng.randrange(256) for _ in range(n)]
            _timed(llm, prompt)  # computed, and stored in host memory
            assert llm.reset_prefix_cache()  # gone from the device
            events.clear()
            seconds, out = _timed(llm, prompt)
            assert out.num_cached_tokens == (n - 1) // 16 * 16, "not loaded from host memory"
            hit.append(seconds)
            loads += [a for name, a in events if name == KV_LOAD]
            computed.append(_timed(cold, prompt)[0])
        print(f"  {n:5d} | {loads[0]['bytes']:9,d} | {statistics.median(a['seconds'] for a in loads):.4f} | "
              f"{statistics.median(hit):.4f} | {statistics.median(computed):.4f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-gpt2")
    ap.add_argument("--lengths", default="64,256,480", help="prompt lengths, comma-separated")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lengths = [int(x) for x in args.lengths.split(",")]
    p2p(args.model, lengths, args.reps)
    offload(args.model, lengths, args.reps)


if __name__ == "__main__":
    main()
