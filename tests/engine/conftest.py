import pytest

from engine import LLM


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-gpt2", num_kv_blocks=256)
