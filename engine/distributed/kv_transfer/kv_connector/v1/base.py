"""The KV connector API (vLLM V1's ``KVConnectorBase_V1``, ``kv_connector/v1/base.py``).

A connector moves KV-cache blocks between this instance and somewhere else (files, another
instance, host memory). It is made twice: once beside the scheduler (``KVConnectorRole.SCHEDULER``)
and once in the worker (``WORKER``); the scheduler side plans, the worker side moves bytes, and
the plan travels in ``SchedulerOutput.kv_connector_metadata``.

Scheduler side, called by engine/core/sched/scheduler.py at V1's points:
    get_num_new_matched_tokens(request, num_computed_tokens)  admitting a request: how many tokens past
        its local prefix-cache hit the connector can deliver, and whether they arrive asynchronously
        (the request then waits as WAITING_FOR_REMOTE_KVS, its blocks allocated, until they are in)
    update_state_after_alloc(request, block_ids, num_external_tokens)  the blocks they go into
    build_connector_meta(scheduler_output)  this step's plan for the workers (resets the plan)
    update_connector_output(connector_output)  what the workers report back after the step
    get_kv_connector_stats()  its counters, for EngineStats (a host-memory tier's size, blocks held, hits)
    request_finished(request, block_ids)  a request finished: (keep its blocks until the workers say
        they are sent, kv_transfer_params for the client)

Worker side, called by engine/worker/model_runner.py and the attention backend:
    register_kv_caches(kv_caches)  {layer name: (K, V)} once the cache is allocated
    start_load_kv()  before the forward pass
    wait_for_layer_load(layer_name)  before a layer's attention (its KV must be in)
    save_kv_layer(layer_name, kv_layer, attn_metadata)  after a layer wrote its KV
    wait_for_save()  after the forward pass
    get_finished(finished_req_ids)  (request ids whose sends finished, ids whose receives finished)
    get_block_ids_with_load_errors()  blocks whose load failed (their tokens are computed instead)

Each transfer is recorded (``record``) and published as one ``kv_transfer`` trace event per request
and kind (save, load, send, recv) with its blocks, bytes and seconds.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from typing import Any

import torch

from engine.hooks import INSTANT, Hooks
from engine.trace_names import KV_TRANSFER


class KVConnectorRole(enum.Enum):
    SCHEDULER = 0  # beside the scheduler, in the engine core
    WORKER = 1  # in the worker, beside the KV cache


class KVConnectorMetadata:
    """A connector's plan for one step, from its scheduler side to its worker side (each connector
    subclasses it as a dataclass of plain values)."""


@dataclass
class TransferRecord:
    kind: str  # save | load | send | recv
    request_id: str
    block_ids: list[int]
    num_bytes: int
    seconds: float
    end_ns: int = 0  # when it ended (time.perf_counter_ns()): its event's time, though published later


class KVConnectorBase_V1:
    """Base class of KV connectors (see the module docstring). config: the EngineConfig (its
    kv_transfer_config the KVTransferConfig)."""

    def __init__(self, config, role: KVConnectorRole):
        if config.kv_transfer_config is None:
            raise ValueError("kv_transfer_config must be set for a KV connector")
        self._config = config
        self._kv_transfer_config = config.kv_transfer_config
        self._role = role
        self._connector_metadata: KVConnectorMetadata | None = None
        self.block_size = config.cache.block_size
        self.kv_caches: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._layer_of: dict[int, str] = {}  # a layer's key cache (its data pointer) -> its name
        self.hooks = Hooks()  # the engine's, set by whoever makes the connector
        self.records: list[TransferRecord] = []  # this step's transfers, until published

    @property
    def role(self) -> KVConnectorRole:
        return self._role

    # ---- worker side --------------------------------------------------------------------------
    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        self._connector_metadata = connector_metadata

    def clear_connector_metadata(self) -> None:
        self._connector_metadata = None

    def _get_connector_metadata(self) -> KVConnectorMetadata:
        assert self._connector_metadata is not None
        return self._connector_metadata

    def has_connector_metadata(self) -> bool:
        return self._connector_metadata is not None

    def register_kv_caches(self, kv_caches: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Each layer's (K, V) cache, [num_blocks, block_size, num_kv_heads, head_size] each."""
        self.kv_caches = kv_caches
        self._layer_of = {k.data_ptr(): name for name, (k, _) in kv_caches.items()}

    def layer_name(self, key_cache: torch.Tensor) -> str:
        """The name of the layer whose key cache this is (the attention backend knows its caches,
        not its layer's name)."""
        return self._layer_of[key_cache.data_ptr()]

    def start_load_kv(self, **kwargs: Any) -> None:
        """Start loading this step's KV into the paged cache (before the forward pass)."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until the layer's KV is loaded (before its attention)."""

    def save_kv_layer(self, layer_name: str, kv_layer: tuple[torch.Tensor, torch.Tensor], attn_metadata,
                      **kwargs: Any) -> None:
        """Start saving the layer's KV (after it wrote this step's tokens)."""

    def wait_for_save(self) -> None:
        """Finish this step's saves (after the forward pass)."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(Requests whose asynchronous sends finished, requests whose asynchronous receives finished.)"""
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load failed since the last call: the scheduler has their tokens computed instead."""
        return set()

    def shutdown(self) -> None:
        """Stop background threads and close sockets."""

    # ---- scheduler side -----------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """(Tokens past num_computed_tokens the connector can deliver (None: ask again later),
        whether they arrive asynchronously, between steps)."""
        return 0, False

    def update_state_after_alloc(self, request, block_ids: list[list[int]], num_external_tokens: int) -> None:
        """The request's blocks (one table per KV-cache group) after allocation; num_external_tokens of
        them are to be loaded."""

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        """This step's plan for the workers; resets the connector's per-step state."""
        return KVConnectorMetadata()

    def update_connector_output(self, connector_output) -> None:
        """What the workers reported after a step (a KVConnectorOutput)."""

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict | None]:
        """A request finished, before its blocks are freed: (True: the connector frees them once
        get_finished reports the request sent, kv_transfer_params for the request's output)."""
        return False, None

    def get_kv_connector_stats(self) -> dict | None:
        """The connector's own counters for EngineStats.kv_connector_stats (V1's name; a plain dict here,
        keyed by the connector's name), or None."""
        return None

    def has_pending_block_frees(self) -> bool:
        """Blocks held for transfers still under way (the engine keeps stepping until they are done)."""
        return False

    # ---- the trace ----------------------------------------------------------------------------
    def record(self, kind: str, request_id: str, block_ids: list[int], num_bytes: int, t0: float) -> None:
        """One transfer, started at time.perf_counter() t0, for the next trace events."""
        end_ns = time.perf_counter_ns()
        self.records.append(TransferRecord(kind, request_id, list(block_ids), num_bytes, end_ns / 1e9 - t0, end_ns))

    def publish_records(self, step: int | None) -> None:
        """One kv_transfer event per request and kind since the last call (layers summed), at the time
        its last part ended (a pull answered between steps is traced when it was, not at the next step)."""
        merged: dict[tuple[str, str], TransferRecord] = {}
        for r in self.records:
            m = merged.setdefault((r.kind, r.request_id), TransferRecord(r.kind, r.request_id, r.block_ids, 0, 0.0))
            m.num_bytes += r.num_bytes
            m.seconds += r.seconds
            m.end_ns = max(m.end_ns, r.end_ns)
        self.records = []
        if merged:
            self.hooks.emit_many([(KV_TRANSFER, m.kind, INSTANT, m.request_id, step,
                                   dict(block_ids=m.block_ids, bytes=m.num_bytes, seconds=m.seconds,
                                        connector=type(self).__name__)) for m in merged.values()],
                                 [m.end_ns for m in merged.values()])


def kv_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)
