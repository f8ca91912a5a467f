"""Speculative decoding (vLLM V1's ``v1/spec_decode/``): proposers that draft tokens cheaply."""
