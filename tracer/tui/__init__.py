"""The Textual TUI: one app over three sources of engine state (live, attached, replayed).

    sources/   where the TraceState and the event stream come from, and where commands go
    widgets/   one module per panel (header, startup, requests, KV cache, step, kernels, log)
    screens/   modal screens (help, breakpoints, request detail, filter, quit confirmation)
    app.py     the app: layout, bindings, the refresh timer, the command palette
"""
