"""`vllm-trace send "prompt"`: one request to a running `vllm-trace serve`, printed.

The text goes to stdout (as it arrives with --stream), the request id and usage to stderr.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from tracer.commands import HelpFormatter
from tracer.errors import UserError

DEFAULT_URL = "http://127.0.0.1:8000"
# The built-in tiny-gpt2 learned Python's documentation, so a prompt from that world gets readable text
# back ("Hello, my name is" gets docstring-speak; "The capital of France is" will not lead to "Paris").
DEFAULT_PROMPT = "The first argument is"


def sample_body(model: str, prompt: str = DEFAULT_PROMPT, max_tokens: int = 16) -> dict:
    """The request the banner and the Startup panel suggest: greedy, as `send` (OpenAI's default
    temperature is 1, which would give a different text each time)."""
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}


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
        with httpx.Client(headers=headers, timeout=args.timeout) as client:
            return _send(client, url, args)
    except (httpx.ConnectError, httpx.ConnectTimeout) as e:
        raise connect_error(url, e) from None
    except ServerError as e:
        print(f"vllm-trace send: server error: {e}", file=sys.stderr)
        return 1


def _send(client, url: str, args: argparse.Namespace) -> int:
    model = args.model or default_model(client, url)
    body = dict(model=model, max_tokens=args.max_tokens, temperature=args.temperature, stream=args.stream)
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
            rid, usage, finish = _print_stream(resp, args.chat)
    else:
        resp = client.post(url + path, json=body)
        if resp.status_code != 200:
            raise ServerError(f"{resp.status_code} {error_message(resp)}")
        data = resp.json()
        choice = data["choices"][0]
        text = choice["message"]["content"] if args.chat else choice["text"]
        print(text)
        rid, usage, finish = data["id"], data["usage"], choice["finish_reason"]
    if usage:
        print(f"[{rid}: {usage['prompt_tokens']} prompt + {usage['completion_tokens']} completion = "
              f"{usage['total_tokens']} tokens, finish_reason={finish}]", file=sys.stderr)
    return 0


def _print_stream(resp, chat: bool):
    rid = usage = finish = None
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
            print(text, end="", flush=True)
            finish = choice.get("finish_reason") or finish
    print()
    return rid, usage, finish
