import gc
import os

# OpenMP's threads sleep between parallel regions instead of spinning (set before torch loads libgomp;
# the processes the tests start inherit it). On a 2-core machine that other work shares, a spinning
# team measured 17x slower than a sleeping one: 2,000 small layer_norm + mm pairs took 7.2 s against
# 0.41 s, and 0.33 s on one thread; the engine's own steps slowed alike.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest
import torch

# Triton's interpreter must be chosen before any kernel module is imported; with a GPU the
# kernels are compiled, so the tests check the code that runs there.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Every process this test session starts inherits this mark, so a test that looks for leftover processes
# in /proc (tests.engine.test_tensor_parallel._worker_pids) counts its own, not another session's or
# another pytest-xdist worker's running beside it.
SESSION_MARK = f"VLLM_TRACE_TEST_SESSION={os.getpid()}"
os.environ["VLLM_TRACE_TEST_SESSION"] = str(os.getpid())


def started_by_this_session(pid: int | str) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return SESSION_MARK.encode() in f.read().split(b"\0")
    except OSError:
        return False


@pytest.fixture(scope="session", autouse=True)
def _model_cache(tmp_path_factory):
    """The built-in model is written once per test session into a private cache."""
    if "VLLM_TRACE_CACHE" not in os.environ:
        os.environ["VLLM_TRACE_CACHE"] = str(tmp_path_factory.mktemp("vllm-trace-cache"))
    yield


def _rss() -> int:
    """This process's resident memory in bytes (0 where /proc is missing: then every thaw collects)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


THAW_AT = 1 << 30  # bytes of growth since the last collection
_collected_at = [0]


@pytest.fixture(autouse=True)
def _free_engines_dropped_without_shutdown():
    """LLM() freezes the heap once its engine is up, as vLLM's EngineCore does, and gc.freeze keeps
    frozen cycles forever: an LLM a test drops without shutdown() would keep its model and KV cache
    (256 MiB by default on a CPU) for the rest of the session. The suite's process grew past 11 GiB
    that way and was killed for memory. After a test that froze the heap, thaw it and collect once the
    process has grown by THAW_AT since the last collection (or has no /proc to say). A full collection
    walks the whole heap (torch, transformers, Textual: 400,000 objects and more): 0.35 s on a quiet
    2-core machine, 0.6-0.7 s late in the suite; after every engine test it was 145 s of make test."""
    yield
    if gc.get_freeze_count() and not 0 < _rss() < _collected_at[0] + THAW_AT:
        gc.unfreeze()
        gc.collect()
        _collected_at[0] = _rss()
