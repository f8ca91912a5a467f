"""OffloadingConnector with a host-memory tier (vLLM V1's ``offloading_connector.py`` and
``v1/kv_offload/``, its CPU backend): ``--kv-offloading-size GiB`` of host memory behind the
device's KV cache.

Every full block a step computes is copied to host memory after the forward pass (store on write,
as V1's), keyed by its prefix-cache hash; the host tier evicts its least recently used blocks when
full. So a block the device pool has evicted is still in host memory, and a request whose prefix is
found there (past its device prefix-cache hit) has those blocks loaded back into its own, layer by
layer before each layer's attention, instead of computed: its prefill computes only the rest.

Each host block holds every layer's K and V of one device block; the scheduler side keeps which
hash is in which host block (with its tokens, to check a hit, as the device prefix cache does).
Loads and stores are synchronous here (V1 runs them on CUDA streams).

kv_connector_extra_config: ``cpu_bytes`` (the tier's size; ``--kv-offloading-size`` sets it).
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from engine.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from engine.trace_names import KV_LOAD, KV_SAVE


@dataclass
class OffloadingConnectorMetadata(KVConnectorMetadata):
    # request id -> (device blocks, host blocks): loads before the forward pass, stores after it
    reqs_to_load: dict[str, tuple[list[int], list[int]]] = field(default_factory=dict)
    reqs_to_store: dict[str, tuple[list[int], list[int]]] = field(default_factory=dict)


class OffloadingConnector(KVConnectorBase_V1):
    def __init__(self, config, role: KVConnectorRole):
        super().__init__(config, role)
        self.cpu_bytes = int(self._kv_transfer_config.get_from_extra_config("cpu_bytes", 0))
        self.num_cpu_blocks = 0  # known once the block's size is (the scheduler side: set by the engine)
        # scheduler side: hash -> (host block, the block's tokens), least recently used first
        self._table: OrderedDict[int, tuple[int, tuple[int, ...]]] = OrderedDict()
        self._free: list[int] = []
        self._requests: dict[str, object] = {}
        self._stored: dict[str, int] = {}  # request id -> its blocks stored (or found stored) so far
        self._to_load: dict[str, tuple[list[int], list[int]]] = {}
        self._first: dict[str, int] = {}  # request id -> its first block past the device's hit, while it asks
        self.num_loaded_blocks = self.num_stored_blocks = self.num_hit_tokens = 0  # since the start (KV-cache panel)
        self.cpu_kv: torch.Tensor | None = None  # worker side: [layers, 2, host blocks, block_size, heads, head]

    def set_num_cpu_blocks(self, bytes_per_block: int) -> None:
        """The tier's blocks: cpu_bytes over one block's K and V of every layer."""
        self.num_cpu_blocks = self.cpu_bytes // bytes_per_block
        if self.num_cpu_blocks < 1:
            raise ValueError(f"kv_offloading_size holds no block: one takes {bytes_per_block} bytes (every layer's "
                             f"K and V), the tier {self.cpu_bytes}; give it more")
        self._free = list(range(self.num_cpu_blocks - 1, -1, -1))

    # ---- scheduler side -----------------------------------------------------------------------
    def _hit(self, request, i: int) -> int | None:
        """The host block holding the request's block i, or None."""
        entry = self._table.get(request.block_hashes[i]) if i < len(request.block_hashes) else None
        bs = self.block_size
        if entry is None or entry[1] != tuple(request.all_token_ids[i * bs:(i + 1) * bs]):
            return None
        return entry[0]

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        """The blocks past the device's hit found in host memory (all but the last token can hit)."""
        first, last = num_computed_tokens // self.block_size, (request.num_tokens - 1) // self.block_size
        i = first
        while i < last and self._hit(request, i) is not None:
            i += 1
        self._first[request.request_id] = first
        return (i - first) * self.block_size, False

    def update_state_after_alloc(self, request, block_ids: list[list[int]], num_external_tokens: int) -> None:
        self._requests[request.request_id] = request
        first = self._first.pop(request.request_id, 0)
        if num_external_tokens <= 0:
            return
        cpu = [self._hit(request, i) for i in range(first, first + num_external_tokens // self.block_size)]
        for i in range(first, first + len(cpu)):
            self._table.move_to_end(request.block_hashes[i])  # used: the last to be evicted
        self._to_load[request.request_id] = (block_ids[0][first:first + len(cpu)], cpu)
        self.num_hit_tokens += num_external_tokens
        self.num_loaded_blocks += len(cpu)

    def build_connector_meta(self, scheduler_output) -> OffloadingConnectorMetadata:
        meta = OffloadingConnectorMetadata(reqs_to_load=self._to_load)
        self._to_load = {}
        loading = {c for _, cpu in meta.reqs_to_load.values() for c in cpu}
        starts = scheduler_output.num_computed_before()
        for rid, num_new in scheduler_output.num_scheduled_tokens.items():
            req = self._requests[rid]
            done = min(starts[rid] + num_new, req.num_tokens) // self.block_size  # full after this step
            stores = self._assign(req, self._stored.get(rid, 0), done, loading)
            self._stored[rid] = max(done, self._stored.get(rid, 0))
            if stores[0]:
                meta.reqs_to_store[rid] = stores
        return meta

    def _assign(self, req, first: int, end: int, loading: set[int]) -> tuple[list[int], list[int]]:
        """Host blocks for the request's blocks [first, end) not in the tier yet (evicting the least
        recently used, never one a load of this step reads)."""
        bs, device, cpu = self.block_size, [], []
        for i in range(first, min(end, len(req.block_hashes))):
            h = req.block_hashes[i]
            if h in self._table:
                continue
            slot = self._free.pop() if self._free else self._evict(loading)
            if slot is None:
                break
            self._table[h] = (slot, tuple(req.all_token_ids[i * bs:(i + 1) * bs]))
            device.append(req.block_ids[i])
            cpu.append(slot)
        self.num_stored_blocks += len(cpu)
        return device, cpu

    def _evict(self, loading: set[int]) -> int | None:
        for h, (slot, _) in self._table.items():
            if slot not in loading:
                del self._table[h]
                return slot
        return None

    def get_kv_connector_stats(self) -> dict:
        """The tier: its size, the blocks it holds, and since the start the blocks stored, the tokens found
        there (hits) and the blocks loaded back."""
        return {"OffloadingConnector": dict(cpu_bytes=self.cpu_bytes, num_cpu_blocks=self.num_cpu_blocks,
                                            num_held_blocks=len(self._table), num_stored_blocks=self.num_stored_blocks,
                                            num_hit_tokens=self.num_hit_tokens,
                                            num_loaded_blocks=self.num_loaded_blocks)}

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict | None]:
        self._requests.pop(request.request_id, None)
        self._stored.pop(request.request_id, None)
        self._to_load.pop(request.request_id, None)
        return False, None

    # ---- worker side --------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches) -> None:
        super().register_kv_caches(kv_caches)
        k, _ = next(iter(kv_caches.values()))
        per_block = 2 * len(kv_caches) * k[0].numel() * k.element_size()
        self.set_num_cpu_blocks(per_block)
        self.cpu_kv = torch.zeros((len(kv_caches), 2, self.num_cpu_blocks, *k.shape[1:]), dtype=k.dtype,
                                  pin_memory=k.is_cuda)
        self._layer_index = {name: i for i, name in enumerate(kv_caches)}

    def wait_for_layer_load(self, layer_name: str) -> None:
        meta: OffloadingConnectorMetadata = self._get_connector_metadata()
        i, (k, v) = self._layer_index[layer_name], self.kv_caches[layer_name]
        for rid, (device, cpu) in meta.reqs_to_load.items():
            t0 = time.perf_counter()
            k[device] = self.cpu_kv[i, 0, cpu].to(k.device)
            v[device] = self.cpu_kv[i, 1, cpu].to(v.device)
            if self.hooks.active:
                self.record(KV_LOAD, rid, device, 2 * k[0].numel() * k.element_size() * len(device), t0)

    def wait_for_save(self) -> None:
        """The step's new full blocks to host memory, every layer (after the forward pass wrote them)."""
        meta: OffloadingConnectorMetadata = self._get_connector_metadata()
        for rid, (device, cpu) in meta.reqs_to_store.items():
            t0 = time.perf_counter()
            for i, (k, v) in enumerate(self.kv_caches.values()):
                self.cpu_kv[i, 0, cpu] = k[device].to("cpu")
                self.cpu_kv[i, 1, cpu] = v[device].to("cpu")
            if self.hooks.active:
                k = next(iter(self.kv_caches.values()))[0]
                self.record(KV_SAVE, rid, device, 2 * len(self.kv_caches) * k[0].numel() * k.element_size()
                            * len(device), t0)
