"""`vllm-trace send "prompt"`: one request to a running `vllm-trace serve`, printed.

The text goes to stdout (as it arrives with --stream), the request id and usage to stderr.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from tracer.commands import HelpFormatter
from tracer.defaults import DEFAULT_PROMPT, DEFAULT_URL
from tracer.errors import UserError
from tracer.net import trust_env


def register(sub) -> None:
    p = sub.add_parser("send", help="send one request to a running server and print the answer",
                       description="Send one completion (or, with --chat, chat) request to a running "
                                   "`vllm-trace serve` and print the text, then the usage.",
                       formatter_class=HelpFormatter)
    p.add_argument("prompt", nargs="?", default=DEFAULT_PROMPT, help="prompt text (with --chat: the user message)")
    p.add_argument("--url", default=DEFAULT_URL, help="server base URL")
    p.add_argument("--chat", action="store_true", help="use /v1/chat/completions (the chat template applies)")
    p.add_argument("--stream", action="store_true", help="print text as it is generated (server-sent events)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens to generate")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy: the same text every time")
    p.add_argument("--model", default=None, help="model name (default: the first one the server lists)")
    p.add_argument("--api-key", default=os.environ.get("VLLM_TRACE_API_KEY"),
                   help="the server's --api-key (default: $VLLM_TRACE_API_KEY)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the answer")
    p.add_argument("--n", type=int, default=1, help="samples of the prompt (child requests sharing its KV blocks; "
                   "with --stream each choice is printed when it ends)")
    p.add_argument("--priority", type=int, default=0,
                   help="the request's priority, for a server run with --scheduling-policy priority (lower first)")
    so = p.add_mutually_exclusive_group()  # structured outputs: at most one constraint
    so.add_argument("--json-schema", metavar="FILE", default=None,
                    help="answer as JSON following the schema in FILE (response_format json_schema)")
    so.add_argument("--regex", default=None, help="answer matching this regular expression (structured_outputs)")
    so.add_argument("--choice", default=None, metavar="A,B,C",
                    help="answer exactly one of these comma-separated strings (structured_outputs)")
    p.set_defaults(handler=run)


class ServerError(Exception):
    """The server answered with an error body."""


def connect_error(url: str, e: Exception):
    return UserError(f"cannot reach a server at {url} ({type(e).__name__}); is `vllm-trace serve` running there?")


def error_message(resp) -> str:
    try:
        return resp.json()["error"]["message"]
    except Exception:
        return resp.text.strip() or resp.reason_phrase


def default_model(client, url: str) -> str:
    resp = client.get(f"{url}/v1/models")
    if resp.status_code != 200:
        raise ServerError(f"GET /v1/models: {resp.status_code} {error_message(resp)}")
    return resp.json()["data"][0]["id"]


def run(args: argparse.Namespace) -> int:
    import httpx

    url = args.url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        with httpx.Client(headers=headers, timeout=args.timeout, trust_env=trust_env(url)) as client:
            return _send(client, url, args)
    except (httpx.ConnectError, httpx.ConnectTimeout) as e:
        raise connect_error(url, e) from None
    except ServerError as e:
        print(f"vllm-trace send: server error: {e}", file=sys.stderr)
        return 1


def _send(client, url: str, args: argparse.Namespace) -> int:
    model = args.model or default_model(client, url)
    body = dict(model=model, max_tokens=args.max_tokens, temperature=args.temperature, stream=args.stream, n=args.n,
                priority=args.priority)
    body.update(structured_output_fields(args))
    if args.chat:
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": args.prompt}]
    else:
        path, body["prompt"] = "/v1/completions", args.prompt
    if args.stream:
        body["stream_options"] = {"include_usage": True}
        with client.stream("POST", url + path, json=body) as resp:
            if resp.status_code != 200:
                resp.read()
                raise ServerError(f"{resp.status_code} {error_message(resp)}")
            rid, usage, finish = _print_stream(resp, args.chat, args.n)
    else:
        resp = client.post(url + path, json=body)
        if resp.status_code != 200:
            raise ServerError(f"{resp.status_code} {error_message(resp)}")
        data = resp.json()
        for choice in data["choices"]:
            if args.n > 1:
                print(f"--- choice {choice['index']}")
            print(choice["message"]["content"] if args.chat else choice["text"])
        rid, usage = data["id"], data["usage"]
        finish = ", ".join(sorted({c["finish_reason"] for c in data["choices"]}))
    if usage:
        print(f"[{rid}: {usage['prompt_tokens']} prompt + {usage['completion_tokens']} completion = "
              f"{usage['total_tokens']} tokens, finish_reason={finish}]", file=sys.stderr)
    return 0


def structured_output_fields(args: argparse.Namespace) -> dict:
    """--json-schema, --regex or --choice as request fields (OpenAI's response_format, vLLM's structured_outputs)."""
    if getattr(args, "json_schema", None):
        try:
            with open(args.json_schema) as f:
                schema = json.load(f)
        except (OSError, ValueError) as e:
            raise UserError(f"--json-schema {args.json_schema}: {e}") from None
        return {"response_format": {"type": "json_schema", "json_schema": {"name": "schema", "schema": schema}}}
    if getattr(args, "regex", None):
        return {"structured_outputs": {"regex": args.regex}}
    if getattr(args, "choice", None):
        return {"structured_outputs": {"choice": [c for c in args.choice.split(",") if c]}}
    return {}


def _print_stream(resp, chat: bool, n: int = 1):
    """Print the text as it comes (one choice), or each choice whole when it ends (n > 1)."""
    rid = usage = finish = None
    texts: dict[int, str] = {}
    for line in resp.iter_lines():
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            break
        chunk = json.loads(data)
        if "error" in chunk:
            raise ServerError(chunk["error"]["message"])
        rid, usage = chunk.get("id", rid), chunk.get("usage") or usage
        for choice in chunk.get("choices", []):
            text = (choice["delta"].get("content") or "") if chat else choice["text"]
            finish = choice.get("finish_reason") or finish
            if n == 1:
                print(text, end="", flush=True)
                continue
            i = choice["index"]
            texts[i] = texts.get(i, "") + text
            if choice.get("finish_reason"):
                print(f"--- choice {i}\n{texts[i]}", flush=True)
    if n == 1:
        print()
    return rid, usage, finish
