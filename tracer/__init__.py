"""The tracer: events, step control, record/replay/export, the TUI and the `vllm-trace` CLI."""
