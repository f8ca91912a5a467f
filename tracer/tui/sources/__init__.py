"""Where the TUI's state comes from. Every panel reads a TraceState (built by the one fold in
tracer.state) and every key press becomes a call on a Source, whichever source it is:

    LiveSource     in-process: a TraceSession on the engine's hooks and its AsyncLLM
    RemoteSource   `vllm-trace attach URL`: /trace/state, the /trace/events stream, /trace/* control
    ReplaySource   `vllm-trace replay FILE`: a recorded trace, with time travel
"""
from tracer.tui.sources.base import Source, SourceInfo, Unsupported

__all__ = ["Source", "SourceInfo", "Unsupported"]
