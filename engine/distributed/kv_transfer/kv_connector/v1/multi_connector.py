"""MultiConnector (vLLM V1's ``multi_connector.py``): several connectors as one, e.g. host-memory
offloading and a transfer between instances.

``kv_connector_extra_config``: ``{"connectors": [{"kv_connector": ..., "kv_role": ...,
"kv_connector_extra_config": {...}}, ...]}`` (a connector's kv_role defaults to the MultiConnector's).
As V1's: every connector sees every request; the first that can deliver a request's tokens loads
them (the others get its blocks with 0 tokens to load); each step's metadata is one per connector;
a finished request's blocks are kept until every connector that kept them has sent them, and their
kv_transfer_params are merged.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from engine.config import KVTransferConfig
from engine.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from engine.hooks import Hooks


@dataclass
class MultiKVConnectorMetadata(KVConnectorMetadata):
    metadata: list = field(default_factory=list)  # one per connector, in order


class MultiConnector(KVConnectorBase_V1):
    def __init__(self, config, role: KVConnectorRole):
        super().__init__(config, role)
        from engine.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        subs = self._kv_transfer_config.get_from_extra_config("connectors", [])
        if not subs or any(c.get("kv_connector") == "MultiConnector" for c in subs):
            raise ValueError('MultiConnector needs "connectors": a list of connector configs (no MultiConnector)')
        self._connectors = [KVConnectorFactory.create_connector(
            replace(config, kv_transfer_config=KVTransferConfig.from_dict(
                {"kv_role": self._kv_transfer_config.kv_role, **c, "engine_id": self._kv_transfer_config.engine_id})),
            role) for c in subs]
        self._chosen: dict[str, int] = {}  # request id -> the connector that loads its tokens
        self._extra_async_saves: dict[str, int] = {}  # request id -> connectors still to report it sent, less one

    @property
    def hooks(self) -> Hooks:
        return self._hooks

    @hooks.setter
    def hooks(self, hooks: Hooks) -> None:
        self._hooks = hooks
        for c in getattr(self, "_connectors", ()):
            c.hooks = hooks

    def set_num_cpu_blocks(self, bytes_per_block: int) -> None:
        for c in self._connectors:
            if hasattr(c, "set_num_cpu_blocks"):
                c.set_num_cpu_blocks(bytes_per_block)

    # ---- worker side --------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches) -> None:
        super().register_kv_caches(kv_caches)
        for c in self._connectors:
            c.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: MultiKVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        for c, m in zip(self._connectors, connector_metadata.metadata):
            c.bind_connector_metadata(m)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        for c in self._connectors:
            c.clear_connector_metadata()

    def start_load_kv(self, **kwargs) -> None:
        for c in self._connectors:
            c.start_load_kv(**kwargs)

    def wait_for_layer_load(self, layer_name: str) -> None:
        for c in self._connectors:
            c.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        for c in self._connectors:
            c.save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)

    def wait_for_save(self) -> None:
        for c in self._connectors:
            c.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, recving = set(), set()
        for c in self._connectors:
            s, r = c.get_finished(finished_req_ids)
            sending |= s or set()
            recving |= r or set()
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set().union(*(c.get_block_ids_with_load_errors() for c in self._connectors))

    def publish_records(self, step: int | None) -> None:
        for c in self._connectors:
            c.publish_records(step)

    def shutdown(self) -> None:
        for c in self._connectors:
            c.shutdown()

    # ---- scheduler side -----------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        answer = (0, False)
        for i, c in enumerate(self._connectors):
            n, load_async = c.get_num_new_matched_tokens(request, num_computed_tokens)
            if n is None:
                return None, False
            if answer[0] == 0 and n > 0:
                self._chosen[request.request_id] = i
                answer = (n, load_async)
        return answer

    def update_state_after_alloc(self, request, block_ids: list[list[int]], num_external_tokens: int) -> None:
        chosen = self._chosen.pop(request.request_id, -1)
        for i, c in enumerate(self._connectors):
            c.update_state_after_alloc(request, block_ids, num_external_tokens if i == chosen else 0)

    def build_connector_meta(self, scheduler_output) -> MultiKVConnectorMetadata:
        return MultiKVConnectorMetadata([c.build_connector_meta(scheduler_output) for c in self._connectors])

    def update_connector_output(self, connector_output) -> None:
        """A request counts as sent once every connector that kept its blocks has sent them."""
        for c in self._connectors:
            c.update_connector_output(connector_output)
        sent = set()
        for rid in connector_output.finished_sending or ():
            extra = self._extra_async_saves.get(rid, 0)
            if extra:
                self._extra_async_saves[rid] = extra - 1
            else:
                self._extra_async_saves.pop(rid, None)
                sent.add(rid)
        connector_output.finished_sending = sent or None

    def get_kv_connector_stats(self) -> dict | None:
        stats = {k: v for c in self._connectors for k, v in (c.get_kv_connector_stats() or {}).items()}
        return stats or None

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict | None]:
        self._chosen.pop(request.request_id, None)
        delays, params = 0, None
        for c in self._connectors:
            delay, p = c.request_finished(request, block_ids)
            delays += bool(delay)
            if p is not None:
                clash = set(p) & set(params or {})
                if clash:
                    raise RuntimeError(f"MultiConnector: connectors answered the same kv_transfer_params {clash}")
                params = {**(params or {}), **p}
        if delays > 1:
            self._extra_async_saves[request.request_id] = delays - 1
        return delays > 0, params
