"""ExampleConnector (vLLM V1's shared-storage example, ``kv_connector/v1/example_connector.py``).

A producer instance saves each prompt's full blocks to files, one safetensors file per layer under
``<shared_storage_path>/<hash of the token prefix>/``; a consumer instance that gets the same prompt
finds that folder (``get_num_new_matched_tokens``) and loads the blocks into its own, layer by layer
just before each layer's attention, so its prefill computes only the tokens not delivered (at least
the last one: its logits sample the first output token). The prefix saved is the prompt's first
``len(prompt) - 1`` tokens rounded down to whole blocks: what a consumer of the same prompt can use.

Unlike V1's example it saves a prompt in the step that completes that prefix (a chunked prefill
writes it over several steps; blocks found in the local prefix cache are saved too), and only the
blocks past the consumer's own prefix-cache hit are loaded. A save is written to a temporary
folder renamed when the step's forward pass is done, so a consumer never sees half a prompt.

kv_connector_extra_config: ``shared_storage_path`` (default /tmp/vllm-trace-kv).
"""
from __future__ import annotations

import hashlib
import os
import shutil
import time
from dataclasses import dataclass, field

import numpy as np
import safetensors.torch

from engine.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    kv_bytes,
)
from engine.trace_names import KV_LOAD, KV_SAVE


@dataclass
class ReqMeta:
    req_id: str
    folder: str  # where the prefix's files are (or go)
    block_ids: list[int]  # the blocks they fill (or come from)
    is_store: bool


@dataclass
class ExampleConnectorMetadata(KVConnectorMetadata):
    requests: list[ReqMeta] = field(default_factory=list)


class ExampleConnector(KVConnectorBase_V1):
    def __init__(self, config, role: KVConnectorRole):
        super().__init__(config, role)
        self.storage_path = self._kv_transfer_config.get_from_extra_config("shared_storage_path",
                                                                          "/tmp/vllm-trace-kv")
        os.makedirs(self.storage_path, exist_ok=True)
        self._requests: dict[str, object] = {}  # scheduler side: every admitted request, by id
        self._need_load: dict[str, int] = {}  # request id -> tokens to load this step
        self._stored: set[str] = set()  # requests whose prefix is saved (or was found saved)
        self._loads: list[ReqMeta] = []  # worker side: this step's loads
        self._saved: list[ReqMeta] = []  # ... and saves, renamed into place by wait_for_save

    # ---- scheduler side -----------------------------------------------------------------------
    def _prefix_len(self, num_prompt_tokens: int) -> int:
        return (num_prompt_tokens - 1) // self.block_size * self.block_size

    def _folder(self, token_ids: list[int]) -> str:
        digest = hashlib.blake2b(np.asarray(token_ids, np.int64).tobytes(), digest_size=16).hexdigest()
        return os.path.join(self.storage_path, digest)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        n = self._prefix_len(request.num_prompt_tokens)
        if not self._kv_transfer_config.is_kv_consumer or n <= num_computed_tokens:
            return 0, False
        if not os.path.isdir(self._folder(request.prompt_token_ids[:n])):
            return 0, False
        return n - num_computed_tokens, False

    def update_state_after_alloc(self, request, block_ids: list[list[int]], num_external_tokens: int) -> None:
        self._requests[request.request_id] = request
        if num_external_tokens > 0:
            self._need_load[request.request_id] = num_external_tokens

    def build_connector_meta(self, scheduler_output) -> ExampleConnectorMetadata:
        meta, bs = ExampleConnectorMetadata(), self.block_size
        starts = scheduler_output.num_computed_before()
        for rid, num_new in scheduler_output.num_scheduled_tokens.items():
            req = self._requests[rid]
            n = self._prefix_len(req.num_prompt_tokens)
            num_load = self._need_load.pop(rid, 0)
            if num_load:  # the delivered tokens end at n; the blocks before them were the prefix cache's
                meta.requests.append(ReqMeta(rid, self._folder(req.prompt_token_ids[:n]),
                                             req.block_ids[(n - num_load) // bs:n // bs], is_store=False))
            elif self._kv_transfer_config.is_kv_producer and 0 < n <= starts[rid] + num_new and rid not in self._stored:
                self._stored.add(rid)  # the prefix is in its blocks by the end of this step
                folder = self._folder(req.prompt_token_ids[:n])
                if not os.path.isdir(folder):
                    meta.requests.append(ReqMeta(rid, folder, req.block_ids[:n // bs], is_store=True))
        return meta

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict | None]:
        self._requests.pop(request.request_id, None)
        self._need_load.pop(request.request_id, None)
        self._stored.discard(request.request_id)
        return False, None

    # ---- worker side --------------------------------------------------------------------------
    def start_load_kv(self, **kwargs) -> None:
        self._loads = [r for r in self._get_connector_metadata().requests if not r.is_store]

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Read the layer's K and V of each request to load into its blocks (synchronously, before
        the layer's attention reads them)."""
        key_cache, value_cache = self.kv_caches[layer_name]
        for r in self._loads:
            t0 = time.perf_counter()
            kv = safetensors.torch.load_file(os.path.join(r.folder, layer_name + ".safetensors"))
            k, v = kv["key"][-len(r.block_ids):], kv["value"][-len(r.block_ids):]  # (past a local cache hit)
            if k.shape[1:] != key_cache.shape[1:]:
                raise ValueError(f"ExampleConnector: the KV in {r.folder} has blocks of shape {list(k.shape[1:])}, "
                                 f"this model's are {list(key_cache.shape[1:])}: a different model or block_size "
                                 f"saved it; use another shared_storage_path")
            key_cache[r.block_ids] = k.to(key_cache.device, key_cache.dtype)
            value_cache[r.block_ids] = v.to(value_cache.device, value_cache.dtype)
            if self.hooks.active:
                self.record(KV_LOAD, r.req_id, r.block_ids, kv_bytes((k, v)), t0)

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        """Write the layer's K and V of each request to save, once the layer has written them."""
        stores = [r for r in self._get_connector_metadata().requests if r.is_store]
        for r in stores:
            t0 = time.perf_counter()
            tmp = r.folder + f".tmp-{os.getpid()}"
            os.makedirs(tmp, exist_ok=True)
            k, v = (c[r.block_ids].cpu().contiguous() for c in kv_layer)
            safetensors.torch.save_file({"key": k, "value": v}, os.path.join(tmp, layer_name + ".safetensors"))
            if self.hooks.active:
                self.record(KV_SAVE, r.req_id, r.block_ids, kv_bytes((k, v)), t0)
        self._saved = stores

    def wait_for_save(self) -> None:
        """Each prompt saved this step appears at once: its temporary folder renamed into place."""
        for r in self._saved:
            tmp = r.folder + f".tmp-{os.getpid()}"
            try:
                os.rename(tmp, r.folder)
            except OSError:  # another instance saved the same prefix first
                shutil.rmtree(tmp, ignore_errors=True)
        self._saved, self._loads = [], []
