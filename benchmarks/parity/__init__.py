"""vLLM's CPU build beside ours: `make parity` (see __main__.py)."""
