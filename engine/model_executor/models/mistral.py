"""Mistral (vLLM's ``models/mistral.py``): Llama's layers, with a sliding window on every layer.

A token at position p attends to positions p - sliding_window + 1 .. p only (config.json's
``sliding_window``; Hugging Face's mask ``key > query - sliding_window``). Nothing in the layers
changes: the window lives in the KV cache's spec (``SlidingWindowSpec``, engine/core/
kv_cache_interface.py), which gives the blocks behind the window back to the pool, and in the
attention metadata of the layer's KV-cache group, which the attention kernel masks and skips by.

Ministral (transformers' ``MinistralForCausalLM``) is the same with ``layer_types`` naming each
layer ``sliding_attention`` or ``full_attention``: a hybrid model, whose sliding-window and
full-attention layers form separate KV-cache groups over one block pool.
"""
from __future__ import annotations

from engine.model_executor.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    """LlamaForCausalLM; its config's sliding_window reaches the KV cache and the attention metadata."""


class MinistralForCausalLM(MistralForCausalLM):
    """MistralForCausalLM; its config's layer_types say which layers slide."""
