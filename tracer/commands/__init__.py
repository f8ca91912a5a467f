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
