"""`vllm-trace`: the command line. Each subcommand lives in its own module under
tracer/commands/ and exposes ``register(subparsers)``; its handler returns an exit code."""
from __future__ import annotations

import argparse
import importlib
import sys

from tracer.errors import UserError

# One module per subcommand, in the order `--help` lists them.
COMMANDS = ["generate", "serve", "attach", "replay", "send", "bench", "export", "lesson", "exercise"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vllm-trace",
        description="A step-through tracer for LLM serving: a real paged-attention engine "
                    "(vLLM v1 semantics, GPT-2) you can watch, pause and step.",
        epilog="The built-in offline model is 'tiny-gpt2'. Run 'vllm-trace COMMAND --help' for details.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"tracer.commands.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "handler", None):
        parser.print_help()
        return 2
    try:
        return args.handler(args) or 0
    except KeyboardInterrupt:
        print(f"vllm-trace {args.command}: interrupted", file=sys.stderr)
        return 130
    except (UserError, ValueError) as e:  # bad input: one clear line, no traceback
        print(f"vllm-trace {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
