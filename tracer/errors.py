"""The tracer's one user-facing error type, in a leaf module so that every command can import it
at the top (tracer/cli.py imports the commands, so it could not live there without cycles)."""
from __future__ import annotations


class UserError(Exception):
    """An error to show the user as one line, without a traceback (``vllm-trace`` catches it)."""
