"""Connector name -> class (vLLM's ``KVConnectorFactory``): the ``kv_connector`` of
``--kv-transfer-config``. Each connector is imported only when named."""
from __future__ import annotations

import importlib

from engine.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole

_V1 = "engine.distributed.kv_transfer.kv_connector.v1."


class KVConnectorFactory:
    _registry: dict[str, tuple[str, str]] = {}

    @classmethod
    def register_connector(cls, name: str, module_path: str, class_name: str) -> None:
        cls._registry[name] = (module_path, class_name)

    @classmethod
    def names(cls) -> list[str]:
        return sorted(cls._registry)

    @classmethod
    def create_connector(cls, config, role: KVConnectorRole) -> KVConnectorBase_V1:
        """The connector config.kv_transfer_config names, for one side (the scheduler's or a worker's)."""
        module_path, class_name = cls._registry[config.kv_transfer_config.kv_connector]
        connector_cls = getattr(importlib.import_module(module_path), class_name)
        return connector_cls(config, role)


KVConnectorFactory.register_connector("ExampleConnector", _V1 + "example_connector", "ExampleConnector")
KVConnectorFactory.register_connector("P2pZmqConnector", _V1 + "p2p_zmq_connector", "P2pZmqConnector")
KVConnectorFactory.register_connector("OffloadingConnector", _V1 + "offloading_connector", "OffloadingConnector")
KVConnectorFactory.register_connector("MultiConnector", _V1 + "multi_connector", "MultiConnector")
