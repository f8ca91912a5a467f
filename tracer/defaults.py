"""Defaults the command line and the TUI share (the TUI imports no command module: commands
sit above it)."""
from __future__ import annotations

DEFAULT_URL = "http://127.0.0.1:8000"
# The built-in tiny-gpt2 learned Python's documentation, so a prompt from that world gets readable text
# back ("Hello, my name is" gets docstring-speak; "The capital of France is" will not lead to "Paris").
DEFAULT_PROMPT = "The first argument is"


def sample_body(model: str, prompt: str = DEFAULT_PROMPT, max_tokens: int = 16) -> dict:
    """The request the banner and the Startup panel suggest: greedy, as `send` (OpenAI's default
    temperature is 1, which would give a different text each time)."""
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
