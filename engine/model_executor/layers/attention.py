"""Attention metadata and backends.

The model runner builds one ``AttentionMetadata`` per step and passes it explicitly to the
model (no hidden globals). A backend is two functions with the kernels' signatures: write the
step's K/V into the paged cache, then attend. ``torch`` uses the PyTorch references,
``triton`` our Triton kernels (see kernels/), and ``cpu`` (vLLM's CPU_ATTN, the default on a CPU) the
C kernel of kernels/cpu for decodes and short queries, the PyTorch reference for longer prefill chunks.

A hybrid model's KV-cache groups (sliding-window and full-attention layers) each have their own
block tables and slot mapping, hence their own metadata: the batch's (the first group's) holds the
others', and a layer takes its group's with ``meta.for_layer(layer_idx)``. A group's
``sliding_window`` is what its layers attend over. A layer with attention sinks (gpt-oss: one
learned logit per query head that joins the softmax) passes them with its call, as vLLM's
``Attention(..., sinks=...)`` holds them.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from engine.config import ATTENTION_BACKENDS

log = logging.getLogger(__name__)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] where each new token's K/V is written
    query_start_loc: torch.Tensor  # [num_seqs + 1] cu_seqlens_q
    seq_lens: torch.Tensor  # [num_seqs] context + new tokens
    block_tables: torch.Tensor  # [num_seqs, max_blocks]
    max_query_len: int
    max_seq_len: int
    plan: object = None  # backend-specific indexing computed once per step (see prepare)
    sliding_window: int | None = None  # this group's layers read the last sliding_window positions only
    # a hybrid model: the other KV-cache groups' metadata (groups 1, 2, ...), and layer -> group
    group_metadata: list[AttentionMetadata] = field(default_factory=list)
    layer_group: dict[int, int] = field(default_factory=dict)
    kv_connector: object = None  # a KV connector's worker side: each layer waits for its loads, then saves

    def for_layer(self, layer_idx: int) -> AttentionMetadata:
        """The metadata of the layer's KV-cache group."""
        g = self.layer_group.get(layer_idx, 0)
        return self if g == 0 else self.group_metadata[g - 1]


class AttentionBackend:
    """Cache write + attention, through the kernels' launch wrapper so every call can be
    observed (Triton launches with their grids; the PyTorch references as plain calls)."""

    def __init__(self, name: str):
        if name not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {name!r}")
        self.name = name
        import kernels  # turns on Triton's interpreter when there is no GPU
        self._kernels = kernels
        if name == "cpu":
            from kernels import cpu
            cpu.require()
            self._cpu = cpu
        self.workspace = kernels.reference.Workspace()  # the torch backend's gathered K/V

    def prepare(self, meta: AttentionMetadata, block_size: int) -> None:
        """Once per step, before the layers: work every layer would otherwise repeat (while
        profiling, an op of its own: ``plan_attention``), once per KV-cache group."""
        if self.name != "triton":
            for m in (meta, *meta.group_metadata):
                args = dict(query_start_loc=m.query_start_loc, seq_lens=m.seq_lens, block_tables=m.block_tables,
                            block_size=block_size, sliding_window=m.sliding_window or None,
                            short_apart=self.name == "cpu")  # (positional:) decodes and short queries to C
                m.plan = self._kernels.instrument.op(
                    "plan_attention", "other", self._kernels.reference.plan_attention, args,
                    reason="the reference's gather indices and masks (and the cpu backend's split), for every layer")

    def forward(self, q, k, v, key_cache, value_cache, meta: AttentionMetadata, scale: float,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        connector = meta.kv_connector
        if connector is None:
            return self._forward(q, k, v, key_cache, value_cache, meta, scale, sinks)
        # V1's wait_for_kv_layer_from_connector / maybe_save_kv_layer_to_connector around the attention op
        layer_name = connector.layer_name(key_cache)
        connector.wait_for_layer_load(layer_name)
        o = self._forward(q, k, v, key_cache, value_cache, meta, scale, sinks)
        connector.save_kv_layer(layer_name, (key_cache, value_cache), meta)
        return o

    def _forward(self, q, k, v, key_cache, value_cache, meta: AttentionMetadata, scale: float,
                 sinks: torch.Tensor | None) -> torch.Tensor:
        kn = self._kernels
        if self.name == "triton":
            kn.reshape_and_cache(k, v, key_cache, value_cache, meta.slot_mapping)
            return kn.unified_attention(q, key_cache, value_cache, meta.query_start_loc, meta.seq_lens,
                                        meta.block_tables, scale, max_query_len=meta.max_query_len,
                                        max_seq_len=meta.max_seq_len, sliding_window=meta.sliding_window,
                                        sinks=sinks)
        call = kn.instrument.call
        call("reshape_and_cache_ref", kn.reshape_and_cache_ref, dict(
            key=k, value=v, key_cache=key_cache, value_cache=value_cache, slot_mapping=meta.slot_mapping),
            reason=_REASON[self.name])
        extra = {"sliding_window": meta.sliding_window} if meta.sliding_window else {}
        if sinks is not None:
            extra["sinks"] = sinks
        args = dict(query=q, key_cache=key_cache, value_cache=value_cache, query_start_loc=meta.query_start_loc,
                    seq_lens=meta.seq_lens, block_tables=meta.block_tables, scale=scale)
        if self.name == "cpu":
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
            if len(meta.plan.short):
                call("cpu_attention_with_kv_cache", self._cpu.cpu_attention_with_kv_cache,
                     dict(args, reqs=meta.plan.short, out=out, **extra), reason=_REASON["cpu"],
                     meta=meta.plan.launch_meta[0])
            if not meta.plan.groups:
                return out
            extra["out"] = out
        return call("unified_attention_ref", kn.unified_attention_ref,
                    dict(args, plan=meta.plan, workspace=self.workspace, **extra), reason=_REASON[self.name],
                    meta=meta.plan.launch_meta[1])


_REASON = {"torch": "attention_backend=torch: PyTorch reference",
           "cpu": "attention_backend=cpu: C kernel for decodes and short queries, PyTorch reference for the rest"}


def default_backend(device: torch.device, dtype: torch.dtype = torch.float32) -> str:
    """Triton on CUDA. On the CPU Triton runs through its interpreter, far slower than PyTorch
    (measured: see README, kernels benchmark), so the C kernels of kernels/cpu for a float32 model
    when they compile here, else the PyTorch references."""
    if device.type == "cuda":
        return "triton"
    from kernels import cpu
    if dtype != torch.float32:
        return "torch"
    if not cpu.available():
        log.warning("attention_backend: torch, not cpu: the C kernels are unavailable (%s); they make a "
                    "CPU step faster", cpu.load())
        return "torch"
    return "cpu"
