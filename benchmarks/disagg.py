"""Disaggregated against colocated serving under a mixed load: TTFT and ITL, served over HTTP.

    python -m benchmarks.disagg [--model tiny-gpt2] [--reps 3] [--short 8] [--long 8]

Two setups, all up for the whole run (the one not driven sits idle on its sockets):
  colocated      one `vllm-trace serve`
  disaggregated  a prefill instance and a decode instance (`serve --kv-transfer-config`, P2pZmqConnector)
                 and `vllm-trace proxy` in front, as the user guide starts them
The same mixed load against each: --short streams (16 prompt tokens, 128 generated) start together, and
--long requests (448 prompt tokens, 8 generated) arrive among them, one every --gap seconds. Every request
is a streamed, greedy completion of seeded random token ids with EOS ignored, timed by `vllm-trace bench`'s
client (TTFT: send -> first chunk; ITL: the gaps between chunks; TPOT: (E2E - TTFT) / (tokens - 1)).
vLLM's `vllm bench serve` draws one length distribution per run and reports one TTFT for all; the
question here is per class (do the long prefills stall the short streams, what does the hop cost the
long ones), so the two classes are timed apart. The setups alternate order from one repetition to the
next; medians over --reps. Each run also gives the servers' CPU seconds (/proc, every process of the
setup) and the load average.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.parity.servers import Server, chat_template_file, get
from benchmarks.serving import cpu_seconds
from tracer.commands.bench import one_request

ROOT = Path(__file__).resolve().parents[1]
SHORT = (16, 128)  # prompt tokens, generated tokens
LONG = (448, 8)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proxy:
    """`vllm-trace proxy` in front of one prefill and one decode instance, up once /health answers."""

    def __init__(self, prefill: str, decode: str, log_path: Path):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [os.path.join(os.path.dirname(sys.executable), "vllm-trace"), "proxy", "--prefill", prefill,
                    "--decode", decode, "--port", str(self.port)]
        self.log_path = log_path

    def __enter__(self) -> Proxy:
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT)
        for _ in range(600):
            if self.proc.poll() is not None:
                raise RuntimeError(f"the proxy exited with {self.proc.returncode}: see {self.log_path}")
            with contextlib.suppress(OSError):
                if get(self.url + "/health")[0] == 200:
                    return self
            time.sleep(0.1)
        raise RuntimeError(f"the proxy is not up after 60 s: see {self.log_path}")

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        self.proc.wait(20)
        self.log.close()


def workload(seed: int, num_short: int, num_long: int) -> list[tuple[str, list[int], int]]:
    """(class, prompt token ids, tokens to generate) for each request."""
    rng = random.Random(seed)
    return ([("short", [rng.randrange(256) for _ in range(SHORT[0])], SHORT[1]) for _ in range(num_short)]
            + [("long", [rng.randrange(256) for _ in range(LONG[0])], LONG[1]) for _ in range(num_long)])


async def drive(url: str, model: str, work, gap: float) -> dict:
    """The mixed load against one setup: per class, each request's TTFT and ITL gaps (seconds)."""
    import httpx

    async def one(client, delay: float, kind: str, prompt: list[int], max_tokens: int):
        await asyncio.sleep(delay)
        return kind, await one_request(client, url, model, prompt, max_tokens)

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0), limits=limits, trust_env=False) as c:
        delays = itertools.count(gap, gap)  # the long ones arrive one every gap seconds, the short ones at once
        results = await asyncio.gather(*(one(c, next(delays) if kind == "long" else 0.0, kind, p, n)
                                         for kind, p, n in work))
    failed = [r.error for _, r in results if not r.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed against {url}: {failed[:3]}")
    out: dict = {}
    for kind, r in results:
        out.setdefault(kind, {"ttft": [], "itl": [], "e2e": [], "tpot": []})
        out[kind]["ttft"].append(r.ttft)
        if r.output_tokens > 1:  # TPOT: the stream's time after its first token, per token
            out[kind]["tpot"].append((r.e2e - r.ttft) / (r.output_tokens - 1))
        out[kind]["itl"].extend(r.itl)
        out[kind]["e2e"].append(r.e2e)
    return out


def summary(run: dict) -> dict:
    def ms(xs, q=None):
        xs = sorted(xs)
        return 1000 * (statistics.median(xs) if q is None else xs[min(len(xs) - 1, int(q * (len(xs) - 1)))])
    return {"long_ttft": ms(run["long"]["ttft"]), "short_ttft": ms(run["short"]["ttft"]),
            "short_itl": ms(run["short"]["itl"]), "short_itl_p99": ms(run["short"]["itl"], 0.99),
            "short_itl_max": ms(run["short"]["itl"], 1.0), "short_tpot": ms(run["short"]["tpot"]),
            "long_e2e": ms(run["long"]["e2e"]), "short_e2e": ms(run["short"]["e2e"])}


def run(args, workdir: Path) -> dict:
    template = chat_template_file(workdir)
    bin_dir = os.path.dirname(sys.executable)

    def kv(role: str) -> tuple:
        extra = {"kv_port": _free_port()} if role == "kv_producer" else {}
        return ("--kv-transfer-config", json.dumps({"kv_connector": "P2pZmqConnector", "kv_role": role,
                                                    "kv_connector_extra_config": extra}))
    results: dict[str, list] = {"colocated": [], "disaggregated": []}
    with contextlib.ExitStack() as stack:
        def up(name: str, port: int, *extra: str) -> Server:
            return stack.enter_context(Server("ours", bin_dir, args.model, port, template, workdir / f"{name}.log",
                                              None, extra))

        colocated = up("colocated", _free_port())
        prefill = up("prefill", _free_port(), *kv("kv_producer"))
        decode = up("decode", _free_port(), *kv("kv_consumer"))
        proxy = stack.enter_context(Proxy(prefill.url, decode.url, workdir / "proxy.log"))
        setups = {"colocated": (colocated.url, [colocated]), "disaggregated": (proxy.url, [prefill, decode])}
        warm = workload(-1, 2, 1)
        for url, _ in setups.values():  # first-use costs out of the measured runs
            asyncio.run(drive(url, args.model, warm, 0.1))
        for rep in range(args.reps):
            work = workload(rep, args.short, args.long)
            order = list(setups) if rep % 2 == 0 else list(setups)[::-1]
            for name in order:
                url, servers = setups[name]
                pids = [p for s in servers for p in s.pids()] + ([proxy.proc.pid] if name != "colocated" else [])
                before, load0 = cpu_seconds(pids), os.getloadavg()[0]
                row = summary(asyncio.run(drive(url, args.model, work, args.gap)))
                after = cpu_seconds(pids)
                row["cpu_s"] = sum(after[p] - before.get(p, after[p]) for p in after)
                row["load"] = (load0, os.getloadavg()[0])
                results[name].append(row)
                print(f"  rep {rep + 1} {name:>13}: " + ", ".join(
                    f"{k} {v:.0f}" if isinstance(v, float) else f"{k} {v[0]:.1f}-{v[1]:.1f}" for k, v in row.items()),
                      file=sys.stderr, flush=True)
    return results


def _cell(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.1f}"


def table(results: dict, args) -> str:
    cols = [("long_ttft", "long: TTFT ms"), ("short_ttft", "short: TTFT ms"), ("short_itl", "short: ITL ms (median)"),
            ("short_itl_p99", "short: ITL ms (p99)"), ("short_itl_max", "short: ITL ms (max)"),
            ("short_tpot", "short: TPOT ms"), ("short_e2e", "short: E2E ms"), ("cpu_s", "servers' CPU s")]
    lines = ["| setup | " + " | ".join(t for _, t in cols) + " |", "|---|" + "---:|" * len(cols)]
    for name, rows in results.items():
        lines.append(f"| {name} | " + " | ".join(_cell(statistics.median(r[k] for r in rows)) for k, _ in cols) + " |")
    loads = [x for rows in results.values() for r in rows for x in r["load"]]
    lines += ["", f"{args.short} short streams ({SHORT[0]} prompt tokens, {SHORT[1]} generated) and {args.long} long "
              f"requests ({LONG[0]} prompt tokens, {LONG[1]} generated, one every {args.gap} s); medians of {args.reps}"
              f" runs per setup; load average {min(loads):.1f}-{max(loads):.1f} during the runs."]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-gpt2")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--short", type=int, default=8, help="short streams per run")
    ap.add_argument("--long", type=int, default=8, help="long requests per run")
    ap.add_argument("--gap", type=float, default=0.25, help="seconds between the long requests' arrivals")
    ap.add_argument("--json", metavar="PATH", help="also write every run's numbers here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="vllm-trace-disagg-") as d:
        results = run(args, Path(d))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    print(table(results, args))


if __name__ == "__main__":
    main()
