"""The built-in model, written once per test session (unless VLLM_TRACE_CACHE names a cache)."""
from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def model_cache(tmp_path_factory):
    if not os.environ.get("VLLM_TRACE_CACHE"):
        os.environ["VLLM_TRACE_CACHE"] = str(tmp_path_factory.mktemp("vtc"))
    return os.environ["VLLM_TRACE_CACHE"]


