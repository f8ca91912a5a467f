"""`vllm-trace bench`: a load generator against a running server, like vLLM's serving benchmark.

Each request is a streamed completion of a seeded random token-id prompt, greedy, with EOS
ignored so it generates exactly its output length. Per request we time TTFT (send -> first
text chunk), ITL (gaps between chunks), TPOT ((e2e - ttft) / (tokens - 1)) and E2E latency.
Arrivals: --request-rate R sends a Poisson stream of R requests/s (vLLM's flag; inf, the default:
all at once); --concurrency C keeps C requests in flight instead. --duration S keeps sending for
S seconds (then waits for the requests in flight), so a slow rate can be watched in the TUI:

    vllm-trace bench --request-rate 1 --duration 60 --output-len 200:400
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field

from tracer.commands.send import connect_error, error_message
from tracer.defaults import DEFAULT_URL
from tracer.errors import UserError
from tracer.net import trust_env

# Token ids every GPT-2-family vocabulary has (the byte-level base tokens).
PROMPT_VOCAB = 256


def length_range(text: str) -> tuple[int, int]:
    """'32' or '8:96' (inclusive range, drawn per request)."""
    lo, _, hi = text.partition(":")
    try:
        a, b = int(lo), int(hi or lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or MIN:MAX, got {text!r}") from None
    if not 1 <= a <= b:
        raise argparse.ArgumentTypeError(f"need 1 <= MIN <= MAX, got {text!r}")
    return a, b


def register(sub) -> None:
    p = sub.add_parser("bench", help="load-test a running server: throughput, TTFT, ITL, latency",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=DEFAULT_URL, help=f"server base URL (default {DEFAULT_URL})")
    p.add_argument("--model", default=None, help="model name (default: the first one the server lists)")
    p.add_argument("--num-requests", type=int, default=None,
                   help="requests to send (default 64; with --duration: as many as it allows)")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--request-rate", type=float, default=float("inf"),
                      help="Poisson arrival rate, requests/s (default inf: all at once)")
    load.add_argument("--concurrency", type=int, default=None, help="keep this many requests in flight instead")
    p.add_argument("--duration", type=float, default=None, metavar="S",
                   help="send for S seconds, at --request-rate or --concurrency (then wait for the last answers)")
    p.add_argument("--prompt-len", type=length_range, default=(32, 32), metavar="N|MIN:MAX",
                   help="prompt tokens per request (default 32)")
    p.add_argument("--output-len", type=length_range, default=(32, 32), metavar="N|MIN:MAX",
                   help="generated tokens per request (default 32)")
    p.add_argument("--seed", type=int, default=0, help="seed for prompts, lengths and arrivals (default 0)")
    p.add_argument("--n", type=int, default=1, help="samples of each prompt (default 1)")
    p.add_argument("--priority", type=int, default=0,
                   help="every request's priority, for a server run with --scheduling-policy priority (default 0)")
    p.add_argument("--json", metavar="PATH", default=None, help="also write the results as JSON here")
    p.add_argument("--api-key", default=os.environ.get("VLLM_TRACE_API_KEY"),
                   help="the server's --api-key (default: $VLLM_TRACE_API_KEY)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(handler=run)


@dataclass
class Result:
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


def make_requests(n: int | None, prompt_len: tuple[int, int], output_len: tuple[int, int], seed: int):
    """(prompt token ids, output length) for each request, seeded; n None: without end (--duration)."""
    rng = random.Random(seed)
    count = itertools.count() if n is None else range(n)
    for _ in count:
        yield [rng.randrange(PROMPT_VOCAB) for _ in range(rng.randint(*prompt_len))], rng.randint(*output_len)


async def one_request(client, url: str, model: str, prompt: list[int], max_tokens: int, n: int = 1,
                      priority: int = 0) -> Result:
    body = dict(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True, stream=True,
                stream_options={"include_usage": True}, n=n, priority=priority)
    start = time.perf_counter()
    res, last = Result(ok=False, prompt_tokens=len(prompt)), None
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                res.error = f"{resp.status_code} {error_message(resp)}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    res.error = chunk["error"]["message"]
                    return res
                if chunk.get("usage"):
                    res.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                if any(c.get("text") for c in chunk.get("choices", [])):
                    now = time.perf_counter()
                    if last is None:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
    except Exception as e:  # a failed request is a result, not the end of the benchmark
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.e2e, res.ok = time.perf_counter() - start, True
    return res


async def _run(args: argparse.Namespace) -> dict:
    import httpx

    url = args.url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(None, connect=10.0), limits=limits,
                                 trust_env=trust_env(url)) as client:
        try:
            resp = await client.get(f"{url}/v1/models")
        except (httpx.ConnectError, httpx.ConnectTimeout) as e:
            raise connect_error(url, e) from None
        if resp.status_code != 200:
            raise UserError(f"GET /v1/models: {resp.status_code} {error_message(resp)}")
        model = args.model or resp.json()["data"][0]["id"]
        work = make_requests(args.num_requests, args.prompt_len, args.output_len, args.seed)
        bar = None
        if not args.no_progress:
            from tqdm.auto import tqdm
            bar = tqdm(total=args.num_requests, desc="bench", unit="req", file=sys.stderr, dynamic_ncols=True)
        gate = asyncio.Semaphore(args.concurrency) if args.concurrency else None
        rng = random.Random(args.seed + 1)

        async def run_one(prompt, max_tokens):
            try:
                res = await one_request(client, url, model, prompt, max_tokens, args.n, args.priority)
            finally:
                if gate is not None:
                    gate.release()
            if bar is not None:
                bar.update(1)
            return res

        start = time.perf_counter()
        deadline = None if args.duration is None else start + args.duration
        tasks = []
        for prompt, max_tokens in work:
            if gate is not None:
                await gate.acquire()  # a slot first: the request is sent when it frees
            if deadline is not None and time.perf_counter() >= deadline:
                if gate is not None:
                    gate.release()
                break
            tasks.append(asyncio.create_task(run_one(prompt, max_tokens)))
            if args.concurrency is None and args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))  # the arrival process itself
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        if bar is not None:
            bar.close()
    return summarize(results, duration, args, model)


def _stats(values: list[float]) -> dict:
    if not values:
        return dict(mean_ms=None, median_ms=None, p99_ms=None)
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]
    return dict(mean_ms=statistics.fmean(values) * 1000, median_ms=statistics.median(values) * 1000,
                p99_ms=p99 * 1000)


def summarize(results: list[Result], duration: float, args: argparse.Namespace, model: str) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return dict(
        model=model, url=args.url, num_requests=len(results), completed=len(ok), failed=len(results) - len(ok),
        errors=sorted({r.error for r in results if not r.ok})[:5],
        request_rate=args.request_rate if args.concurrency is None else None, concurrency=args.concurrency,
        send_duration_s=args.duration,
        duration_s=duration, total_input_tokens=in_tokens, total_output_tokens=out_tokens,
        request_throughput=len(ok) / duration, output_throughput=out_tokens / duration,
        total_token_throughput=(in_tokens + out_tokens) / duration,
        ttft=_stats([r.ttft for r in ok]), tpot=_stats(tpot), itl=_stats([g for r in ok for g in r.itl]),
        e2e=_stats([r.e2e for r in ok]),
    )


def print_report(s: dict) -> None:
    rows = [("Successful requests", s["completed"]), ("Failed requests", s["failed"]),
            ("Duration (s)", f"{s['duration_s']:.2f}"), ("Input tokens", s["total_input_tokens"]),
            ("Output tokens", s["total_output_tokens"]),
            ("Request throughput (req/s)", f"{s['request_throughput']:.2f}"),
            ("Output token throughput (tok/s)", f"{s['output_throughput']:.2f}"),
            ("Total token throughput (tok/s)", f"{s['total_token_throughput']:.2f}")]
    print("=" * 20 + " Serving Benchmark Result " + "=" * 20)
    for k, v in rows:
        print(f"{k:<40}{v:>20}")
    for key, title in [("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st)"),
                       ("itl", "Inter-token Latency"), ("e2e", "End-to-end Latency")]:
        print(f"{'-' * 15} {title} {'-' * 15}")
        for stat in ("mean", "median", "p99"):
            v = s[key][f"{stat}_ms"]
            print(f"{stat.capitalize() + ' ' + key.upper() + ' (ms)':<40}{'-' if v is None else f'{v:.2f}':>20}")
    for err in s["errors"]:
        print(f"error: {err}")
    print("=" * 66)


def run(args: argparse.Namespace) -> int:
    if ((args.num_requests is not None and args.num_requests < 1) or (args.concurrency is not None
                                                                      and args.concurrency < 1)
            or args.request_rate <= 0 or (args.duration is not None and args.duration <= 0)):
        raise UserError("--num-requests, --concurrency, --request-rate and --duration must be positive")
    if args.duration is None:
        args.num_requests = args.num_requests or 64
    elif args.concurrency is None and args.request_rate == float("inf"):
        raise UserError("--duration needs a pace: --request-rate R (Poisson, R a second) or --concurrency C")
    summary = asyncio.run(_run(args))
    print_report(summary)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0 if summary["failed"] == 0 else 1
