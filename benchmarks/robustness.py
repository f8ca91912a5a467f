"""Robustness: `vllm-trace serve` under fuzzing, bad input, load, cancellation, control races,
a long run and a drain, each against a real server process, with figures printed.

    python -m benchmarks.robustness [--only NAME ...] [--cases 2000] [--requests 2000]

Targets, one line each, PASS or FAIL:

    fuzz         >= 2,000 schemathesis cases, response conformance checked: 0 x 5xx, 0 failures
    bad_input    >= 80 hand-made bad requests: every one a 4xx with an OpenAI error body
    streams      256 concurrent streams: none lost, none duplicated (text == the non-streamed one)
    cancel       128 streams, half cancelled mid-way: 0 KV blocks and 0 requests left
    control      4 clients hammering /trace control during 64 streams: no deadlock, no 5xx
    big_prompt   10 MiB, 900 KiB and 6 KiB prompts beside 2-token requests: refused at once, nobody stalls
    memory       RSS growth over 2,000 traced requests <= 25 MiB; /trace/state < 100 ms after them
    drain        48 long streams, SIGINT with --drain-timeout 1: each ends with [DONE] or an error event
    trace_ints   /trace integers past any bound (step n = 2**64, ...): every one a 4xx
    slow_heads   100 idle and 100 half-sent connections: all closed within 15 s, requests answered meanwhile
    ipc_garbage  1,000 frames that are not the core's pushed into the API server's output socket: requests
                 still answered, /health 200
    frozen_core  32 streams, the engine core SIGSTOPped: /health not 200 within 15 s, 200 again within 15 s
                 of SIGCONT, all 32 finish
    tp_sockets   --tensor-parallel-size 2: nothing of the process tree listens beyond loopback; kill -9 of
                 the core leaves no socket directory behind
    big_trace    a 100 MiB trace: export peaks under 400 MiB RSS; replay (index, a step, the end, back) too
    logs         no "Traceback" in any server's log

The server is the built-in tiny-gpt2 on this machine's device, traced (the default), headless.
Timings on a shared machine are distorted by whatever else runs; the pass criteria are counts,
except big_prompt's, memory's, frozen_core's and big_trace's figures.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from benchmarks.procfs import is_loopback, listening_addresses, unix_socket_paths

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "The quick brown fox"
DEADLINE = 300.0  # s: any one scenario; hitting it is a deadlock


# ---- the server ---------------------------------------------------------------------------
@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    log: Path

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def rss_mib(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise RuntimeError("no VmRSS")

    def stop(self, sig=signal.SIGINT, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def spawn(logdir: Path, name: str, *args: str) -> Server:
    log = logdir / f"{name}.log"
    out = open(log, "w")
    env = os.environ | {"PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-m", "tracer.cli", "serve", "tiny-gpt2", "--port", "0", "--no-tui",
                             *args], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)
    end = time.monotonic() + 300
    while time.monotonic() < end:
        m = re.search(r"^Ready: .* at (http://\S+)", log.read_text(errors="replace"), re.M)
        if m:
            return Server(proc, m.group(1), log)
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"serve did not start:\n{log.read_text(errors='replace')}")


# ---- results ------------------------------------------------------------------------------
@dataclass
class Result:
    name: str
    ok: bool
    figures: str
    details: list[str] = field(default_factory=list)


def is_openai_error(resp: httpx.Response) -> bool:
    try:
        err = resp.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return isinstance(err, dict) and isinstance(err.get("message"), str) and isinstance(err.get("type"), str) \
        and set(err) <= {"message", "type", "param", "code"}


async def read_stream(client: httpx.AsyncClient, path: str, body: dict, cancel_after: int | None = None) -> dict:
    """One SSE request: its data frames, whether it ended with [DONE], and error events."""
    frames, done, errors = [], False, []
    async with client.stream("POST", path, json=body | {"stream": True}) as r:
        if r.status_code != 200:
            await r.aread()
            return {"status": r.status_code, "frames": [], "done": False, "errors": [r.text]}
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                done = True
                continue
            obj = json.loads(data)
            (errors if "error" in obj else frames).append(obj)
            if cancel_after is not None and len(frames) >= cancel_after:
                return {"status": 200, "frames": frames, "done": False, "errors": errors, "cancelled": True}
    return {"status": 200, "frames": frames, "done": done, "errors": errors}


def stream_text(frames: list[dict]) -> tuple[str, list]:
    text = "".join(c.get("text") or (c.get("delta") or {}).get("content") or "" for f in frames for c in f["choices"])
    reasons = [c["finish_reason"] for f in frames for c in f["choices"] if c.get("finish_reason")]
    return text, reasons


async def metric(client: httpx.AsyncClient, name: str) -> float:
    text = (await client.get("/metrics")).text
    m = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M)
    return float(m.group(1)) if m else float("nan")


async def wait_idle(client: httpx.AsyncClient, timeout: float = 60) -> tuple[float, float, float]:
    """(running, waiting, kv use) once nothing runs, or as they are at the timeout."""
    end = time.monotonic() + timeout
    while True:
        vals = [await metric(client, f"vllm:{n}") for n in ("num_requests_running", "num_requests_waiting",
                                                             "kv_cache_usage_perc")]
        if vals == [0, 0, 0] or time.monotonic() > end:
            return tuple(vals)
        await asyncio.sleep(0.1)


# ---- scenarios ----------------------------------------------------------------------------
def fuzz(server: Server, cases: int) -> Result:
    """schemathesis' CLI, all response-conformance checks. The trace control endpoints run in
    a second pass without the OpenAI ones: a fuzzed pause would hold every completion.
    benchmarks.fuzz_hooks caps a fuzzed /trace/step wait at 1 s (an idle engine waits it out)."""
    checks = ("not_a_server_error,status_code_conformance,content_type_conformance,"
              "response_headers_conformance,response_schema_conformance")
    passes = [("openai+server", ["--exclude-path-regex", "^/trace/"]),
              ("trace", ["--include-path-regex", "^/trace/", "--exclude-path", "/trace/events"])]
    total, failures, details = 0, 0, []
    per_op = max(1, cases // 10)  # only ~9 operations take input: the rest give one case each
    for label, extra in passes:
        cmd = [sys.executable, "-m", "schemathesis.cli", "run", server.url + "/openapi.json", "--checks", checks,
               "--max-examples", str(per_op), "--request-timeout", "60", "--no-color", "--seed", "1",
               "--suppress-health-check", "all", "--workers", "2", *extra]
        env = os.environ | {"SCHEMATHESIS_HOOKS": "benchmarks.fuzz_hooks", "PYTHONPATH": str(ROOT)}
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, cwd=ROOT, env=env)
        out = proc.stdout + proc.stderr
        m = re.search(r"Test cases:\s*\n?\s*([\d,]+) generated, ([\d,]+) found ([\d,]+) unique failures", out)
        m2 = re.search(r"([\d,]+) generated, ([\d,]+) passed", out)
        if m:
            n, bad = int(m.group(1).replace(",", "")), int(m.group(3).replace(",", ""))
        elif m2:
            n, bad = int(m2.group(1).replace(",", "")), 0
        else:
            n, bad = 0, 1
            details.append(f"{label}: could not read schemathesis' summary:\n{out[-3000:]}")
        if proc.returncode != 0 and bad == 0:
            bad = 1
            details.append(f"{label}: schemathesis exited {proc.returncode}:\n{out[-3000:]}")
        elif bad:
            details.append(f"{label}:\n{out[-6000:]}")
        total += n
        failures += bad
        print(f"   fuzz pass {label}: {n} cases, {bad} failures", flush=True)
        # back to a running engine after the trace pass (a fuzzed pause or run_until)
        httpx.post(server.url + "/trace/resume", json={}, timeout=10)
    fivexx = len(re.findall(r"Server error", "\n".join(details)))
    return Result("fuzz", total >= 2000 and failures == 0,
                  f"{total} cases, {failures} failures ({fivexx} server errors among them)", details)


def bad_inputs(max_model_len: int) -> list[tuple[str, str, dict | bytes | None, dict]]:
    """(label, path, body, headers): requests that must each get a 4xx with an OpenAI error."""
    big = 2 ** 70
    json_h = {"Content-Type": "application/json"}
    cmpl, chat = "/v1/completions", "/v1/chat/completions"
    msg = [{"role": "user", "content": "hi"}]
    cases: list[tuple[str, str, dict | bytes | None, dict]] = []
    for key in ("max_tokens", "top_k", "min_tokens", "n", "logprobs", "seed"):
        cases.append((f"{key} 2**70", cmpl, {"prompt": "x", key: big}, {}))
        cases.append((f"{key} -2**70", cmpl, {"prompt": "x", key: -big}, {}))
    cases += [("stop_token_ids [2**70]", cmpl, {"prompt": "x", "stop_token_ids": [big]}, {}),
              ("prompt ids [2**70]", cmpl, {"prompt": [big]}, {}),
              ("prompt ids [[2**70]]", cmpl, {"prompt": [[1], [big]]}, {}),
              ("chat max_completion_tokens 2**70", chat, {"messages": msg, "max_completion_tokens": big}, {}),
              ("chat max_tokens 2**70", chat, {"messages": msg, "max_tokens": big}, {}),
              ("chat top_logprobs 2**70", chat, {"messages": msg, "logprobs": True, "top_logprobs": big}, {}),
              ("detokenize [2**70]", "/detokenize", {"tokens": [big]}, {})]
    for label, body in [("prompt", {"prompt": "\ud800x"}), ("prompt list", {"prompt": ["ok", "\udfffx"]}),
                        ("stop", {"prompt": "x", "stop": "\ud800"}), ("stop list", {"prompt": "x", "stop": ["\ud800"]}),
                        ("user", {"prompt": "x", "user": "\ud800"}), ("model", {"prompt": "x", "model": "\ud800"})]:
        cases.append((f"lone surrogate in {label}", cmpl, body, {}))
    cases += [("lone surrogate in chat content", chat, {"messages": [{"role": "user", "content": "\ud800"}]}, {}),
              ("lone surrogate in chat part", chat,
               {"messages": [{"role": "user", "content": [{"type": "text", "text": "a\udc00"}]}]}, {}),
              ("lone surrogate in chat name", chat,
               {"messages": [{"role": "user", "content": "x", "name": "\ud800"}]}, {}),
              ("lone surrogate in /tokenize", "/tokenize", {"prompt": "\ud800"}, {})]
    values = {"temperature": [-1, "hot", -0.5], "top_p": [0, 1.5, -1], "top_k": [-2],
              "min_p": [-0.1, 2], "presence_penalty": [3, -3], "frequency_penalty": [2.5],
              "repetition_penalty": [0, -1],
              "max_tokens": [0, -1, 10 ** 6, "many"], "min_tokens": [-1, 100], "n": [2, 0], "logprobs": [21, -1],
              "stop": [[""], ""], "seed": ["x"], "echo": ["maybe"], "stream": ["perhaps"],
              "stream_options": [{"include_usage": True}]}
    for key, vals in values.items():
        for v in vals:
            cases.append((f"{key}={v!r}", cmpl, {"prompt": "x", key: v}, {}))
    cases += [("no prompt", cmpl, {}, {}), ("empty prompt list", cmpl, {"prompt": []}, {}),
              ("prompt dict", cmpl, {"prompt": {"a": 1}}, {}), ("prompt null", cmpl, {"prompt": None}, {}),
              ("token id -1", cmpl, {"prompt": [-1]}, {}), ("token id past vocab", cmpl, {"prompt": [10 ** 9]}, {}),
              ("over-long token list", cmpl, {"prompt": [1] * max_model_len}, {}),
              ("over-long text (chars)", cmpl, {"prompt": "x" * (max_model_len * 20)}, {}),
              ("over-long text (tokens)", cmpl, {"prompt": "x" * max_model_len}, {}),
              ("max_tokens past context", cmpl, {"prompt": "x", "max_tokens": max_model_len}, {}),
              ("unknown model", cmpl, {"prompt": "x", "model": "gpt-9"}, {}),
              ("echo with logprobs", cmpl, {"prompt": "x", "echo": True, "logprobs": 1}, {}),
              ("nan temperature", cmpl, b'{"prompt": "x", "temperature": NaN}', json_h),
              ("infinite top_p", cmpl, b'{"prompt": "x", "top_p": Infinity}', json_h),
              ("malformed JSON", cmpl, b'{"prompt": ', json_h), ("JSON array body", cmpl, b"[1, 2]", json_h),
              ("JSON string body", cmpl, b'"x"', json_h), ("invalid UTF-8", cmpl, b'{"prompt": "\xff"}', json_h),
              ("body over the cap", cmpl, b'{"prompt": "' + b"x" * (2 * 2 ** 20) + b'"}', json_h),
              ("chat no messages", chat, {"messages": []}, {}), ("chat bad role", chat,
                                                                 {"messages": [{"role": "robot", "content": "x"}]}, {}),
              ("chat top_logprobs without logprobs", chat, {"messages": msg, "top_logprobs": 2}, {}),
              ("chat top_logprobs 21", chat, {"messages": msg, "logprobs": True, "top_logprobs": 21}, {}),
              ("chat content number", chat, {"messages": [{"role": "user", "content": 5}]}, {}),
              ("tokenize both", "/tokenize", {"prompt": "x", "messages": msg}, {}),
              ("tokenize neither", "/tokenize", {}, {}), ("detokenize -1", "/detokenize", {"tokens": [-1]}, {}),
              ("detokenize past vocab", "/detokenize", {"tokens": [10 ** 6]}, {}),
              ("unknown route", "/v1/nothing", {}, {}),
              ("pause as a form", "/trace/pause", b"a=1", {"Content-Type": "application/x-www-form-urlencoded"}),
              ("pause as text/plain", "/trace/pause", b"{}", {"Content-Type": "text/plain"}),
              ("pause without a type", "/trace/pause", b"", {}),
              ("step n 0", "/trace/step", {"n": 0}, {}), ("step granularity", "/trace/step", {"granularity": "x"}, {}),
              ("step timeout 2**70", "/trace/step", {"timeout": big}, {}),
              ("run_until nonsense", "/trace/run_until", {"condition": "whenever"}, {}),
              ("breakpoint nonsense", "/trace/breakpoints", {"condition": "layer:gpu"}, {}),
              ("breakpoint surrogate", "/trace/breakpoints", {"condition": "request:\ud800"}, {})]
    return cases


async def bad_input(server: Server) -> Result:
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
        max_model_len = (await c.get("/v1/models")).json()["data"][0]["max_model_len"]
        cases = bad_inputs(max_model_len)
        bad = []
        for label, path, body, headers in cases:
            if isinstance(body, bytes) or body is None:
                r = await c.post(path, content=body or b"", headers=headers)
            else:  # json.dumps keeps a lone surrogate as its \ud800 escape, as a client would send it
                r = await c.post(path, content=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
            if not (400 <= r.status_code < 500 and is_openai_error(r)):
                bad.append(f"{label}: {r.status_code} {r.text[:200]}")
        # the engine is still fine afterwards
        ok = (await c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4})).status_code == 200
    return Result("bad_input", len(cases) >= 80 and not bad and ok,
                  f"{len(cases)} cases, {len(cases) - len(bad)} answered 4xx with an OpenAI error body"
                  + ("" if ok else "; the server failed a good request afterwards"), bad)


def _body(i: int, max_tokens: int) -> dict:
    return {"prompt": f"{PROMPT} {i}", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


async def streams(server: Server, n: int = 256, max_tokens: int = 24) -> Result:
    limits = httpx.Limits(max_connections=n + 8)
    async with httpx.AsyncClient(base_url=server.url, timeout=DEADLINE, limits=limits) as c:
        distinct = 16  # prompts; their non-streamed texts are the reference
        refs = {}
        for i in range(distinct):
            r = await c.post("/v1/completions", json=_body(i, max_tokens))
            refs[i] = r.json()["choices"][0]["text"]
        t = time.perf_counter()
        results = await asyncio.gather(*(read_stream(c, "/v1/completions", _body(i % distinct, max_tokens))
                                         for i in range(n)))
        dt = time.perf_counter() - t
        state = await wait_idle(c)
    problems = []
    for i, res in enumerate(results):
        text, reasons = stream_text(res["frames"])
        if res["status"] != 200 or not res["done"] or res["errors"]:
            problems.append(f"stream {i}: status {res['status']}, done {res['done']}, errors {res['errors'][:1]}")
        elif text != refs[i % distinct] or reasons != ["length"]:
            problems.append(f"stream {i}: text {text!r} != {refs[i % distinct]!r} or finish reasons {reasons}")
    return Result("streams", not problems and state == (0, 0, 0),
                  f"{n} concurrent streams in {dt:.1f} s: {n - len(problems)} complete and exact, "
                  f"{len(problems)} lost/duplicated/cut; afterwards running/waiting/KV {state}", problems[:10])


async def cancel(server: Server, n: int = 128, max_tokens: int = 64) -> Result:
    async with httpx.AsyncClient(base_url=server.url, timeout=DEADLINE,
                                 limits=httpx.Limits(max_connections=n + 8)) as c:
        tasks = [read_stream(c, "/v1/completions", _body(i, max_tokens), cancel_after=2 if i % 2 else None)
                 for i in range(n)]
        # non-streamed ones too: a client that gives up on one takes the 499 path
        plain = [asyncio.ensure_future(c.post("/v1/completions", json=_body(i, max_tokens), timeout=0.3))
                 for i in range(16)]
        results = await asyncio.gather(*tasks)
        await asyncio.gather(*plain, return_exceptions=True)
        state = await wait_idle(c)
    cancelled = sum(1 for r in results if r.get("cancelled"))
    complete = sum(1 for r in results if r["done"] and not r["errors"])
    return Result("cancel", cancelled == n // 2 and complete == n - n // 2 and state == (0, 0, 0),
                  f"{n} streams, {cancelled} cancelled, {complete} complete, 16 non-streamed abandoned; "
                  f"afterwards running/waiting/KV use {state} (0 = no leaked blocks)")


async def control(server: Server, n: int = 64, clients: int = 4, max_tokens: int = 32,
                  min_seconds: float = 20) -> Result:
    statuses: dict[int, int] = {}
    stop = asyncio.Event()

    async def hammer(k: int) -> int:
        calls = 0
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
            ops = [("POST", "/trace/pause", {}), ("POST", "/trace/step", {"n": 1 + k, "granularity": "phase"}),
                   ("POST", "/trace/resume", {}), ("POST", "/trace/breakpoints", {"condition": "finish"}),
                   ("GET", "/trace/state", None), ("POST", "/trace/run_until", {"condition": "layer:scheduler"}),
                   ("DELETE", "/trace/run_until", None), ("POST", "/trace/step", {"granularity": "kernel"}),
                   ("GET", "/trace/breakpoints", None), ("POST", "/trace/resume", {})]
            while not stop.is_set():
                method, path, body = ops[calls % len(ops)]
                r = await c.request(method, path, json=body)
                statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
                if path == "/trace/breakpoints" and method == "POST" and r.status_code < 300:
                    await c.delete(f"/trace/breakpoints/{r.json()['id']}")
                calls += 1
            return calls

    async with httpx.AsyncClient(base_url=server.url, timeout=DEADLINE,
                                 limits=httpx.Limits(max_connections=n + 8)) as c:
        hammers = [asyncio.ensure_future(hammer(k)) for k in range(clients)]

        async def one(i: int) -> dict:
            return await read_stream(c, "/v1/completions", _body(i, max_tokens))

        load = asyncio.ensure_future(asyncio.gather(*(one(i) for i in range(n))))
        deadlock = False
        t = time.perf_counter()
        try:
            await asyncio.wait_for(asyncio.shield(load), timeout=60)
        except asyncio.TimeoutError:
            pass  # the hammering may keep it held: stop hammering, resume, then it must finish
        await asyncio.sleep(max(0.0, min_seconds - (time.perf_counter() - t)))  # hammer an idle engine too
        stop.set()
        calls = sum(await asyncio.gather(*hammers))
        await c.post("/trace/resume", json={})
        try:
            results = await asyncio.wait_for(load, timeout=120)
        except asyncio.TimeoutError:
            deadlock, results = True, []
        state = await wait_idle(c)
    fivexx = sum(v for k, v in statuses.items() if k >= 500)
    complete = sum(1 for r in results if r["done"] and not r["errors"] and stream_text(r["frames"])[1] == ["length"])
    return Result("control", not deadlock and fivexx == 0 and complete == n and state == (0, 0, 0),
                  f"{calls} control calls from {clients} clients during {n} streams: statuses "
                  f"{dict(sorted(statuses.items()))}, "
                  f"{complete}/{n} streams complete, deadlock: {deadlock}")


async def big_prompt(server: Server) -> Result:
    """Huge prompts beside small requests: the small ones' latency, and the time to refuse."""
    async with httpx.AsyncClient(base_url=server.url, timeout=DEADLINE) as c:
        small = {"prompt": "Hi", "max_tokens": 2}
        base = []
        for _ in range(5):
            t = time.perf_counter()
            await c.post("/v1/completions", json=small)
            base.append(time.perf_counter() - t)

        async def refuse(size: int) -> tuple[int, float]:
            t = time.perf_counter()
            r = await c.post("/v1/completions", json={"prompt": "hello " * (size // 6), "max_tokens": 2})
            return r.status_code, time.perf_counter() - t

        async def smalls() -> list[float]:
            out = []
            for _ in range(20):
                t = time.perf_counter()
                await c.post("/v1/completions", json=small)
                out.append(time.perf_counter() - t)
            return out

        (s10, t10), (s1, t1), (s_small, t_small), lat = await asyncio.gather(
            refuse(10 * 2 ** 20), refuse(900 * 2 ** 10), refuse(6 * 1024), smalls())
    worst = max(lat)
    ok = s10 == 413 and s1 == 400 and s_small == 400 and max(t10, t1, t_small) < 2 and worst < 2
    return Result("big_prompt", ok,
                  f"10 MiB prompt: {s10} in {t10 * 1000:.0f} ms, 900 KiB: {s1} in {t1 * 1000:.0f} ms, 6 KiB: "
                  f"{s_small} in {t_small * 1000:.0f} ms; 2-token requests meanwhile: worst {worst * 1000:.0f} ms "
                  f"(alone: median {sorted(base)[2] * 1000:.0f} ms)")


async def memory(server: Server, requests: int) -> Result:
    async with httpx.AsyncClient(base_url=server.url, timeout=DEADLINE,
                                 limits=httpx.Limits(max_connections=40)) as c:
        sem = asyncio.Semaphore(32)

        async def one(i: int) -> int:
            async with sem:
                body = _body(i, 8) | ({"stream": True} if i % 2 else {})
                if i % 2:
                    return (await read_stream(c, "/v1/completions", body))["status"]
                return (await c.post("/v1/completions", json=body)).status_code

        warm = await asyncio.gather(*(one(i) for i in range(400)))  # past the kept window: steady state
        await wait_idle(c)
        rss0 = server.rss_mib()
        t = time.perf_counter()
        codes = await asyncio.gather(*(one(i) for i in range(requests)))
        dt = time.perf_counter() - t
        await wait_idle(c)
        rss1 = server.rss_mib()
        times, built = [], []
        for _ in range(10):
            t = time.perf_counter()
            r = await c.get("/trace/state")
            times.append(time.perf_counter() - t)
            built.append(float(r.headers["server-timing"].partition("dur=")[2]) / 1000)
        size = len(r.content)
        kept = len(r.json()["state"]["requests"])
    growth = rss1 - rss0
    bad = sum(1 for x in warm + codes if x != 200)
    median = sorted(times)[len(times) // 2]
    return Result("memory", growth <= 25 and max(built) < 0.1 and median < 0.1 and bad == 0,
                  f"{requests} traced requests in {dt:.0f} s: RSS {rss0:.0f} -> {rss1:.0f} MiB (+{growth:.1f} MiB); "
                  f"then /trace/state ({size / 1024:.0f} KiB, {kept} requests kept) built in at most "
                  f"{max(built) * 1000:.0f} ms (server), round trip median {median * 1000:.0f} ms, worst "
                  f"{max(times) * 1000:.0f} ms (client, 10 reads); {bad} non-200")


async def drain(logdir: Path, n: int = 48) -> tuple[Result, Server]:
    server = spawn(logdir, "drain", "--drain-timeout", "1")
    async with httpx.AsyncClient(base_url=server.url, timeout=DEADLINE,
                                 limits=httpx.Limits(max_connections=n + 8)) as c:
        started = asyncio.Event()
        count = 0

        async def one(i: int) -> dict:
            nonlocal count
            body = _body(i, 400) | {"stream": True}
            frames, done, errors, ended = [], False, [], "ok"
            try:
                async with c.stream("POST", "/v1/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if not line.startswith("data: "):
                            continue
                        if line == "data: [DONE]":
                            done = True
                            continue
                        obj = json.loads(line[6:])
                        (errors if "error" in obj else frames).append(obj)
                        if len(frames) == 1:
                            count += 1
                            if count == n:
                                started.set()
            except httpx.HTTPError as e:
                ended = f"{type(e).__name__}: {e}"
            return {"frames": frames, "done": done, "errors": errors, "ended": ended}

        tasks = asyncio.ensure_future(asyncio.gather(*(one(i) for i in range(n))))
        await asyncio.wait_for(started.wait(), DEADLINE)
        t = time.perf_counter()
        server.proc.send_signal(signal.SIGINT)
        results = await tasks
        t_streams = time.perf_counter() - t
    code = await asyncio.to_thread(server.proc.wait, 60)
    t_exit = time.perf_counter() - t
    silent = [r for r in results if not r["done"] and not r["errors"]]
    with_error = sum(1 for r in results if r["errors"])
    finished = sum(1 for r in results if r["done"] and not r["errors"])
    last = [ln for ln in server.log_text().splitlines() if ln.startswith("vllm-trace serve: stopped")]
    ok = not silent and all(r["done"] for r in results) and code == 0
    return Result("drain", ok,
                  f"{n} streams, SIGINT, --drain-timeout 1: {finished} finished, {with_error} ended with an error "
                  f"event + [DONE], {len(silent)} cut silently; streams over in {t_streams:.1f} s, exit {code} in "
                  f"{t_exit:.1f} s; {last[-1] if last else 'no exit line'!r}",
                  [str(r["ended"]) for r in silent[:5]]), server


async def second_sigterm(logdir: Path, n: int = 8) -> tuple[Result, Server]:
    """A second SIGTERM forces the exit, as a second Ctrl-C does."""
    server = spawn(logdir, "sigterm", "--drain-timeout", "60")
    async with httpx.AsyncClient(base_url=server.url, timeout=DEADLINE) as c:
        tasks = asyncio.ensure_future(asyncio.gather(*(read_stream(c, "/v1/completions", _body(i, 480))
                                                       for i in range(n)), return_exceptions=True))
        while await metric(c, "vllm:num_requests_running") < n:
            await asyncio.sleep(0.05)
        t = time.perf_counter()
        server.proc.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.5)
        server.proc.send_signal(signal.SIGTERM)
        results = await tasks
    code = await asyncio.to_thread(server.proc.wait, 30)
    dt = time.perf_counter() - t
    ended = sum(1 for r in results if isinstance(r, dict) and r["done"])
    return Result("sigterm", code == 0 and dt < 10 and ended == n,
                  f"two SIGTERMs with --drain-timeout 60: exit {code} after {dt:.1f} s; {ended}/{n} streams "
                  f"ended with [DONE]"), server


async def trace_ints(server: Server) -> Result:
    """Integers past every bound, into each integer the trace API takes."""
    cases = [("POST", "/trace/step", {"n": 2 ** 64}), ("POST", "/trace/step", {"n": 2 ** 63}),
             ("POST", "/trace/step", {"n": 10 ** 9 + 1}), ("POST", "/trace/step", {"n": -(2 ** 64)}),
             ("POST", "/trace/step", {"n": 1, "wait": True, "timeout": 10 ** 400}),
             ("GET", f"/trace/events?since={2 ** 64}", None), ("DELETE", f"/trace/breakpoints/{2 ** 64}", None)]
    async with httpx.AsyncClient(base_url=server.url, timeout=DEADLINE) as c:
        codes = []
        for method, path, body in cases:
            r = await c.request(method, path, json=body) if body is not None else await c.request(method, path)
            codes.append(r.status_code)
        await c.post("/trace/resume", json={})
    bad = [f"{m} {p} {b}: {code}" for (m, p, b), code in zip(cases, codes) if not 400 <= code < 500]
    return Result("trace_ints", not bad, f"{len(cases)} out-of-range integers: statuses {sorted(set(codes))}", bad)


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=30)


async def slow_heads(server: Server, n: int = 200) -> Result:
    """Connections that never send a whole request head hold a socket each until closed."""
    socks = [_connect(server.url) for _ in range(n)]
    for s in socks[n // 2:]:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
    t = time.perf_counter()
    async with httpx.AsyncClient(base_url=server.url, timeout=DEADLINE) as c:
        answered = (await c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})).status_code
    t_answer = time.perf_counter() - t

    def closed_after(s: socket.socket) -> float | None:
        s.settimeout(max(0.1, 30 - (time.perf_counter() - t)))
        try:
            while s.recv(4096):
                pass
        except (ConnectionResetError, socket.timeout):
            pass
        finally:
            s.close()
        elapsed = time.perf_counter() - t
        return elapsed if elapsed < 30 else None

    waits = await asyncio.to_thread(lambda: [closed_after(s) for s in socks])
    open_left = sum(w is None for w in waits)
    last = max((w for w in waits if w is not None), default=float("nan"))
    return Result("slow_heads", answered == 200 and not open_left and last < 15,
                  f"{n // 2} idle + {n // 2} half-sent connections: all closed after {last:.1f} s ({open_left} "
                  f"still open at 30 s); a request meanwhile: {answered} in {t_answer * 1000:.0f} ms")


async def ipc_garbage(server: Server, frames: int = 1000) -> Result:
    """Frames that are not the engine core's, pushed into the API server's output socket."""
    import msgspec
    import zmq

    path = next(p for p in unix_socket_paths(server.proc.pid) if p.endswith("/output"))
    rng = __import__("random").Random(0)
    kinds = [lambda: os.urandom(rng.randint(0, 1 << 16)), lambda: b"",
             lambda: msgspec.msgpack.encode({"a": rng.random()}),
             lambda: msgspec.msgpack.encode([[], [], [], [], [], [], None, None, False, [rng.randint(0, 9)]]),
             lambda: msgspec.msgpack.encode([[[1, 2]]]), lambda: msgspec.msgpack.encode(list(range(20)))]
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.connect("ipc://" + path)
    t = time.perf_counter()
    for i in range(frames):
        push.send(kinds[i % len(kinds)]())
    push.close(linger=5000)
    ctx.term()
    t_push = time.perf_counter() - t
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
        t = time.perf_counter()
        codes = await asyncio.gather(*(c.post("/v1/completions", json=_body(i, 8)) for i in range(16)))
        t_req = time.perf_counter() - t
        health = (await c.get("/health")).status_code
    ok_reqs = sum(r.status_code == 200 for r in codes)
    skipped = len(re.findall(r"not an engine message", server.log_text()))
    return Result("ipc_garbage", ok_reqs == 16 and health == 200,
                  f"{frames} bad frames pushed in {t_push:.1f} s ({skipped} warning lines, at most one a second); "
                  f"then 16 requests: {ok_reqs} x 200 in {t_req:.1f} s; /health {health}")


def _core_pid(server: Server) -> int:
    return int(re.search(r"engine core pid (\d+)", server.log_text()).group(1))


async def frozen_core(logdir: Path, n: int = 32) -> tuple[Result, Server]:
    server = spawn(logdir, "frozen")
    core = _core_pid(server)

    async def health(c: httpx.AsyncClient) -> int:
        try:  # the server answers within its ping timeout (5 s): a client that gave up would hide when
            return (await c.get("/health", timeout=10)).status_code
        except httpx.TimeoutException:
            return 0

    async def until(c: httpx.AsyncClient, pred, limit: float) -> float | None:
        t = time.perf_counter()
        while time.perf_counter() - t < limit:
            if pred(await health(c)):
                return time.perf_counter() - t
            await asyncio.sleep(0.25)
        return None

    async with httpx.AsyncClient(base_url=server.url, timeout=DEADLINE,
                                 limits=httpx.Limits(max_connections=n + 8)) as c:
        tasks = asyncio.ensure_future(asyncio.gather(*(read_stream(c, "/v1/completions", _body(i, 64))
                                                       for i in range(n))))
        while await metric(c, "vllm:num_requests_running") < n:
            await asyncio.sleep(0.05)
        os.kill(core, signal.SIGSTOP)
        try:
            down = await until(c, lambda code: code == 503, 15)
            await asyncio.sleep(5)  # frozen a while longer: /health stays down, requests wait
            still_down = await health(c) != 200
        finally:
            os.kill(core, signal.SIGCONT)
        up = await until(c, lambda code: code == 200, 15)
        results = await tasks
    finished = sum(1 for r in results if r["done"] and not r["errors"] and stream_text(r["frames"])[1] == ["length"])

    def fmt(x: float | None) -> str:
        return "never" if x is None else f"{x:.1f} s"
    return Result("frozen_core", down is not None and still_down and up is not None and finished == n,
                  f"{n} streams, core SIGSTOPped: /health 503 after {fmt(down)}; SIGCONT: 200 after "
                  f"{fmt(up)}; {finished}/{n} streams finished"), server


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


async def tp_sockets(logdir: Path) -> tuple[Result, Server]:

    server = spawn(logdir, "tp", "--tensor-parallel-size", "2")
    core = _core_pid(server)
    workers = _children(core)
    tree = [server.proc.pid, core, *workers]
    listening = listening_addresses(tree)
    beyond = [f"pid {pid}: {addr}:{port}" for pid, addr, port in listening if not is_loopback(addr)]
    dirs = {os.path.dirname(p) for p in unix_socket_paths(core) if "vllm-trace-workers-" in p}
    os.kill(core, signal.SIGKILL)
    code = await asyncio.to_thread(server.proc.wait, 60)
    left = [d for d in dirs if os.path.exists(d)]
    return Result("tp_sockets", not beyond and len(workers) == 2 and dirs and not left and code == 1,
                  f"TP=2, {len(tree)} processes: {len(listening)} listening TCP sockets, "
                  f"{len(listening) - len(beyond)} on loopback ({', '.join(sorted(a for _, a in listening))}); "
                  f"kill -9 of the core: serve exit {code}, {len(left)} socket directory left", beyond), server


def big_trace(logdir: Path, megabytes: float = 100) -> Result:
    from benchmarks.big_trace import REPLAY_MOVES, make, peak_rss_mib, run_measured

    trace = logdir / "big.jsonl"
    events, size = make(trace, megabytes)
    t = time.perf_counter()
    rss_export, proc = peak_rss_mib("export", str(trace), "-o", str(logdir / "big.json"))
    t_export = time.perf_counter() - t
    t = time.perf_counter()
    rss_replay, rproc = run_measured(REPLAY_MOVES, str(trace))
    t_replay = time.perf_counter() - t
    ok = proc.returncode == 0 and rproc.returncode == 0 and rss_export < 400 and rss_replay < 400
    out = (logdir / "big.json").stat().st_size if proc.returncode == 0 else 0
    details = [x.stderr.strip()[-500:] for x in (proc, rproc) if x.returncode]
    trace.unlink()
    (logdir / "big.json").unlink(missing_ok=True)
    return Result("big_trace", ok,
                  f"{size / 2 ** 20:.0f} MiB trace ({events} events): export peak RSS {rss_export:.0f} MiB in "
                  f"{t_export:.1f} s ({out / 2 ** 20:.0f} MiB written); replay (index, a middle step, the end, "
                  f"back, home) peak RSS {rss_replay:.0f} MiB in {t_replay:.1f} s", details)


# ---- main ---------------------------------------------------------------------------------
SCENARIOS = ("fuzz", "bad_input", "streams", "cancel", "control", "big_prompt", "memory", "drain", "sigterm",
             "trace_ints", "slow_heads", "ipc_garbage", "frozen_core", "tp_sockets", "big_trace")


async def run(args) -> list[Result]:
    logdir = Path(args.logdir or tempfile.mkdtemp(prefix="robustness-"))
    logdir.mkdir(parents=True, exist_ok=True)
    only = set(args.only or SCENARIOS)
    results, servers = [], []

    def report(res: Result) -> None:
        results.append(res)
        print(f"{'PASS' if res.ok else 'FAIL'}  {res.name:<10} {res.figures}", flush=True)
        for d in res.details[:10]:
            print("        " + d.replace("\n", "\n        "), flush=True)

    shared = only & {"fuzz", "bad_input", "streams", "cancel", "control", "big_prompt", "memory", "trace_ints",
                     "slow_heads", "ipc_garbage"}
    if shared:
        server = spawn(logdir, "main", "--num-kv-blocks", "256", "--max-num-seqs", "256")
        servers.append(server)
        print(f"server {server.url}, log {server.log}", flush=True)
        try:
            if "bad_input" in only:
                report(await bad_input(server))
            if "streams" in only:
                report(await streams(server))
            if "cancel" in only:
                report(await cancel(server))
            if "control" in only:
                report(await control(server))
            if "big_prompt" in only:
                report(await big_prompt(server))
            if "memory" in only:
                report(await memory(server, args.requests))
            if "trace_ints" in only:
                report(await trace_ints(server))
            if "slow_heads" in only:
                report(await slow_heads(server))
            if "ipc_garbage" in only:
                report(await ipc_garbage(server))
            if "fuzz" in only:
                report(await asyncio.to_thread(fuzz, server, args.cases))
        finally:
            server.stop()
    if "drain" in only:
        res, server = await drain(logdir)
        servers.append(server)
        report(res)
    if "sigterm" in only:
        res, server = await second_sigterm(logdir)
        servers.append(server)
        report(res)
    for name, scenario in (("frozen_core", frozen_core), ("tp_sockets", tp_sockets)):
        if name in only:
            res, server = await scenario(logdir)
            server.stop()
            servers.append(server)
            report(res)
    if "big_trace" in only:
        report(await asyncio.to_thread(big_trace, logdir))
    tracebacks = {s.log.name: s.log_text().count("Traceback") for s in servers}
    report(Result("logs", not any(tracebacks.values()),
                  f"tracebacks per server log: {tracebacks} (logs in {logdir})"))
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="+", choices=SCENARIOS, help="run only these scenarios")
    p.add_argument("--cases", type=int, default=2000, help="schemathesis cases to aim for (default 2000)")
    p.add_argument("--requests", type=int, default=2000, help="requests in the memory run (default 2000)")
    p.add_argument("--logdir", default=None, help="where the server logs go (default: a temporary directory)")
    args = p.parse_args(argv)
    if args.cases < 1 or args.requests < 1:
        p.error("--cases and --requests must be >= 1")
    results = asyncio.run(run(args))
    failed = [r.name for r in results if not r.ok]
    print(f"\n{len(results) - len(failed)}/{len(results)} targets met"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
