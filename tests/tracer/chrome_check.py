"""A structural check of Chrome trace-event JSON, as ui.perfetto.dev and chrome://tracing read it."""
from __future__ import annotations

REQUIRED = {
    "X": ("name", "ph", "ts", "dur", "pid", "tid"),
    "b": ("name", "ph", "ts", "pid", "cat", "id"),
    "e": ("name", "ph", "ts", "pid", "cat", "id"),
    "C": ("name", "ph", "ts", "pid", "args"),
    "M": ("name", "ph", "pid", "args"),
    "i": ("name", "ph", "ts", "pid", "tid"),
    "s": ("name", "ph", "ts", "pid", "tid", "cat", "id"),  # a flow's start ...
    "f": ("name", "ph", "ts", "pid", "tid", "cat", "id"),  # ... and its end
}


def check_chrome_trace(trace: dict) -> list[str]:
    """Problems found (empty if none): required fields per phase type, b/e pairs that match and
    nest per async track, X slices that nest per thread, timestamps monotonic per track, each flow
    started once and ended once."""
    problems = []
    events = trace.get("traceEvents")
    if not isinstance(events, list):
        return ["no traceEvents list"]
    last_ts: dict[tuple, float] = {}
    async_stacks: dict[tuple, list[str]] = {}
    x_stacks: dict[tuple, list[float]] = {}  # end times of the open slices on a thread
    flows: dict[tuple, list[str]] = {}  # (cat, id) -> its ends' phases
    for i, ev in enumerate(events):
        ph = ev.get("ph")
        if ph not in REQUIRED:
            problems.append(f"#{i}: unknown ph {ph!r}")
            continue
        missing = [k for k in REQUIRED[ph] if k not in ev]
        if missing:
            problems.append(f"#{i} ({ph} {ev.get('name')}): missing {missing}")
            continue
        if ph == "M":
            if ev["name"] in ("process_name", "thread_name") and not ev["args"].get("name"):
                problems.append(f"#{i}: {ev['name']} without args.name")
            continue
        if ph == "C" and not all(isinstance(v, (int, float)) for v in ev["args"].values()):
            problems.append(f"#{i}: counter {ev['name']} has a non-numeric value")
        track = ("async", ev["pid"], ev["cat"], ev["id"]) if ph in "be" else \
            ("counter", ev["pid"], ev["name"]) if ph == "C" else ("thread", ev["pid"], ev["tid"])
        if ev["ts"] < last_ts.get(track, float("-inf")):
            problems.append(f"#{i} ({ph} {ev['name']}): ts {ev['ts']} goes back on track {track}")
        last_ts[track] = ev["ts"]
        if ph in "sf":
            flows.setdefault((ev["cat"], ev["id"]), []).append(ph)
        elif ph == "b":
            async_stacks.setdefault(track, []).append(ev["name"])
        elif ph == "e":
            stack = async_stacks.get(track, [])
            if not stack or stack[-1] != ev["name"]:
                problems.append(f"#{i}: e {ev['name']!r} does not close the innermost open b {stack[-1:]}")
            else:
                stack.pop()
        elif ph == "X":
            if ev["dur"] < 0:
                problems.append(f"#{i}: negative dur")
            stack = x_stacks.setdefault(track, [])
            while stack and stack[-1] <= ev["ts"] + 1e-6:
                stack.pop()
            if stack and ev["ts"] + ev["dur"] > stack[-1] + 1e-6:
                problems.append(f"#{i}: X {ev['name']!r} overlaps its enclosing slice without nesting in it")
            stack.append(ev["ts"] + ev["dur"])
    problems += [f"async track {t}: never closed {s}" for t, s in async_stacks.items() if s]
    problems += [f"flow {f}: {ends} (one s, then one f)" for f, ends in flows.items() if ends != ["s", "f"]]
    return problems
