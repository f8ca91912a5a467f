"""KV transfer between instances (vLLM's ``vllm/distributed/kv_transfer``): the V1 connector API
(kv_connector/v1/base.py) and its connectors, made by kv_connector/factory.py."""
