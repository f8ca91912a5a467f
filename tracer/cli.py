"""`vllm-trace`: the command line. Each subcommand lives in its own module under
tracer/commands/ and exposes ``register(subparsers)``; its handler returns an exit code.

Packages above the tracer add subcommands of their own through the ``vllm_trace.commands``
entry-point group: each entry point names a ``register(subparsers)``, called after the
tracer's own. The lessons add ``lesson`` and ``exercise`` this way (pyproject.toml), so the
tracer never imports them. Entry points live in the installed package metadata: after
changing them, reinstall (``pip install -e .``)."""
from __future__ import annotations

import argparse
import sys

from tracer.errors import UserError  # a leaf module of one class: nothing slow

# One module per subcommand, in the order `--help` lists them.
COMMANDS = ["generate", "serve", "attach", "replay", "send", "bench", "export", "roofline", "proxy"]
ENTRY_POINT_GROUP = "vllm_trace.commands"


def command_plugins() -> list:
    """The entry points (importlib.metadata.EntryPoint) of ENTRY_POINT_GROUP, one per name, in name order."""
    import importlib.metadata
    found = {}
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        found.setdefault(ep.name, ep)  # the same package seen twice on sys.path: the first wins
    return [found[name] for name in sorted(found)]


def build_parser() -> argparse.ArgumentParser:
    import importlib
    import importlib.metadata
    parser = argparse.ArgumentParser(
        prog="vllm-trace",
        description="A step-through tracer for LLM serving: a real paged-attention engine in vLLM V1's shape "
                    "(GPT-2, Llama, Qwen3, Mistral, Gemma 3, Qwen3-MoE, Mixtral, gpt-oss) you can watch, pause "
                    "and step.",
        epilog="Built-in offline models: tiny-gpt2 (the default), tiny-llama, tiny-moe. "
               "Run 'vllm-trace COMMAND --help' for details.")
    parser.add_argument("--version", action="version",
                        version=f"vllm-trace {importlib.metadata.version('vllm-trace')}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"tracer.commands.{name}").register(sub)
    for ep in command_plugins():
        try:
            register = ep.load()
        except Exception as e:  # one broken add-on must not take `serve` and the rest down with it
            print(f"vllm-trace: the commands of {ep.value} ({ENTRY_POINT_GROUP}) did not load: {e}", file=sys.stderr)
            continue
        register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # Named before anything slow: a Ctrl-C while the commands' modules load (a second on a busy machine)
    # is the same one line and status 130 as one while the command runs, never a traceback. So the
    # slow import (importlib.metadata: 24 ms idle, far more on a busy machine, and its C extensions) waits for the try.
    command = next((arg for arg in argv if not arg.startswith("-")), "")
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        if not getattr(args, "handler", None):
            parser.print_help()
            return 2
        return args.handler(args) or 0
    except KeyboardInterrupt:
        print(f"vllm-trace {command}: interrupted" if command else "vllm-trace: interrupted", file=sys.stderr)
        return 130
    except (UserError, ValueError) as e:  # bad input: one clear line, no traceback
        print(f"vllm-trace {command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
