import os

import pytest
import torch

# Triton's interpreter must be chosen before any kernel module is imported; with a GPU the
# kernels are compiled, so the tests check the code that runs there.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session", autouse=True)
def _model_cache(tmp_path_factory):
    """The built-in model is written once per test session into a private cache."""
    if "VLLM_TRACE_CACHE" not in os.environ:
        os.environ["VLLM_TRACE_CACHE"] = str(tmp_path_factory.mktemp("vllm-trace-cache"))
    yield
