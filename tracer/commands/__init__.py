"""The subcommands of `vllm-trace`, one module each (see tracer/cli.py)."""
from __future__ import annotations

import argparse


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's, but an option whose help already says its default, or whose default is None
    or False, gets no "(default: ...)" added: it printed "(default: the first one the server
    lists) (default: None)", and the value of an API key taken from the environment."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default is None or action.default is False:
            return text
        return super()._get_help_string(action)


def model_help() -> str:
    """What the MODEL argument takes, every built-in model named (they are offline)."""
    from engine.builtin_model import (
        DRAFT_NAME,
        LLAMA_NAME,
        LLAMA_RANDOM_NAME,
        MOE_NAME,
        MOE_RANDOM_NAME,
        NAME,
        RANDOM_NAME,
    )

    return (f"a built-in model (offline): {NAME}, {LLAMA_NAME}, {MOE_NAME} (a mixture of experts), {DRAFT_NAME} "
            f"(tiny-gpt2's draft model for speculative decoding), {RANDOM_NAME}, {LLAMA_RANDOM_NAME} or "
            f"{MOE_RANDOM_NAME} (random weights, byte-level tokenizer); a Hugging Face name such as gpt2; "
            "or a local directory")
