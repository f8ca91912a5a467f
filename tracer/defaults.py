"""Defaults the command line and the TUI share (the TUI imports no command module: commands
sit above it)."""
from __future__ import annotations

DEFAULT_URL = "http://127.0.0.1:8000"
# The built-in tiny-gpt2 learned Python's documentation, so a prompt from that world gets readable text
# back ("Hello, my name is" gets docstring-speak; "The capital of France is" will not lead to "Paris").
DEFAULT_PROMPT = "The first argument is"
