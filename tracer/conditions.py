"""Conditions on events, for breakpoints and run-until.

A ``Condition`` matches an event by layer, name and request id, and a kernel launch by its
kernel name. The same condition is written as text in the TUI and over HTTP:

    arrive[:ID]   finish[:ID]   preempt[:ID]   request:ID   layer:LAYER   kernel:NAME   event:LAYER.NAME
    event:LAYER.*   (any event of that layer: event:structured_output.* stops at grammars and masks)
    expert:L:E      (a mixture of experts: a step in which expert E of decoder layer L receives tokens)

``kernel:NAME`` names a kernel's family: it also stops at ``NAME_ref``, the PyTorch reference
that the torch backend launches in its place, and at the C kernel that the cpu backend launches
(``kernel:unified_attention`` stops at ``unified_attention_ref`` and ``cpu_attention_with_kv_cache``;
see ``engine.trace_names.KERNEL_STAND_INS``), so one condition works on every backend.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.trace_names import (
    ABORTED,
    ENGINE,
    FINISHED,
    KERNEL,
    KERNEL_STAND_INS,
    MODEL_RUNNER,
    PREEMPTED,
    QUEUED,
    ROUTING,
    SCHEDULER,
)
from tracer.events import LAYERS


@dataclass(frozen=True)
class Condition:
    layer: str | None = None
    name: str | None = None  # an event name, or for layer "kernel" the kernel's name
    names: tuple[str, ...] = ()  # alternatives to `name` (FINISHED or ABORTED)
    request_id: str | None = None
    label: str = ""
    expert: tuple[int, int] | None = None  # (decoder layer, expert): a routing event where it receives tokens

    def matches(self, layer: str, name: str, request_id: str | None, attrs: dict | None = None) -> bool:
        if self.layer is not None and layer != self.layer:
            return False
        if self.name is not None and name != self.name and name not in self.names:
            return False
        if self.expert is not None and not _routes_to(attrs or {}, *self.expert):
            return False
        return self.request_id is None or request_id == self.request_id

    def __str__(self) -> str:
        return self.label or f"{self.layer or '*'}.{self.name or '*'}" + (
            f":{self.request_id}" if self.request_id else ""
        )


def on_arrive(request_id: str | None = None) -> Condition:
    return Condition(ENGINE, QUEUED, request_id=request_id, label=_label("arrive", request_id))


def on_finish(request_id: str | None = None) -> Condition:
    return Condition(ENGINE, FINISHED, (ABORTED,), request_id, _label("finish", request_id))


def on_preempt(request_id: str | None = None) -> Condition:
    return Condition(SCHEDULER, PREEMPTED, request_id=request_id, label=_label("preempt", request_id))


def on_request(request_id: str) -> Condition:
    return Condition(request_id=request_id, label=f"request:{request_id}")


def on_layer(layer: str) -> Condition:
    if layer not in LAYERS:
        raise ValueError(f"unknown layer {layer!r}; layers are {', '.join(LAYERS)}")
    return Condition(layer, label=f"layer:{layer}")


def on_kernel(name: str | None = None) -> Condition:
    """A launch of kernel NAME or of a kernel standing in for it (see the module docstring)."""
    family = KERNEL_STAND_INS.get(name, (f"{name}_ref",)) if name and not name.endswith("_ref") else ()
    return Condition(KERNEL, name, family, label=_label("kernel", name))


def on_event(layer: str, name: str) -> Condition:
    """event:LAYER.NAME; event:LAYER.* is any event of the layer (event:structured_output.*)."""
    return Condition(layer, None if name == "*" else name, label=f"event:{layer}.{name}")


def on_expert(layer_idx: int, expert: int) -> Condition:
    """expert:L:E: the routing event of decoder layer L in a step where expert E receives tokens."""
    return Condition(MODEL_RUNNER, ROUTING, label=f"expert:{layer_idx}:{expert}", expert=(layer_idx, expert))


def _routes_to(attrs: dict, layer_idx: int, expert: int) -> bool:
    counts = attrs.get("expert_counts") or ()
    return attrs.get("layer_idx") == layer_idx and expert < len(counts) and counts[expert] > 0


def _parse_expert(text: str, arg: str | None) -> Condition:
    layer_idx, colon, expert = (arg or "").partition(":")
    if not (colon and layer_idx.strip().isdigit() and expert.strip().isdigit()):
        raise ValueError(f"bad condition {text!r}: write expert:LAYER:EXPERT with two numbers (expert:0:3)")
    return on_expert(int(layer_idx), int(expert))


def _label(kind: str, arg: str | None) -> str:
    return kind if arg is None else f"{kind}:{arg}"


def parse_condition(text: str) -> Condition:
    """'finish:3' -> on_finish('3'), etc. (see the module docstring)."""
    kind, colon, arg = text.strip().partition(":")
    if colon and not arg.strip():  # "finish:" is not "finish": a name was meant and is missing
        raise ValueError(f"bad condition {text!r}: nothing after ':' (write {kind!r} alone for any)")
    arg = arg or None
    simple = {"arrive": on_arrive, "finish": on_finish, "preempt": on_preempt, "kernel": on_kernel}
    if kind in simple:
        return simple[kind](arg)
    if kind in ("request", "layer") and arg:
        return on_request(arg) if kind == "request" else on_layer(arg)
    if kind == "expert":
        return _parse_expert(text, arg)
    if kind == "event" and arg and all(part.strip() for part in arg.split(".", 1)) and "." in arg:
        return on_event(*arg.split(".", 1))
    raise ValueError(f"bad condition {text!r}: use arrive[:ID], finish[:ID], preempt[:ID], request:ID, "
                     f"layer:LAYER, kernel:NAME, event:LAYER.NAME or expert:LAYER:EXPERT")
