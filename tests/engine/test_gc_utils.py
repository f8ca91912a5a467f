import gc

from engine.gc_utils import YOUNG_THRESHOLD, raise_young_threshold


def test_raise_young_threshold_changes_only_the_young_generation():
    before = gc.get_threshold()
    try:
        gc.set_threshold(700, 7, 9)
        raise_young_threshold()
        assert gc.get_threshold() == (YOUNG_THRESHOLD, 7, 9)
        raise_young_threshold(0)  # 0 would turn collection off: at least 1
        assert gc.get_threshold() == (1, 7, 9)
    finally:
        gc.set_threshold(*before)


def test_an_llm_dropped_without_shutdown_is_freed_once_the_heap_thaws():
    """LLM() freezes the heap (as vLLM's EngineCore does): an engine dropped without shutdown() stays
    until the heap is thawed, and then nothing holds it, not even the executor thread of async
    scheduling waiting for its next call (it used to keep the last call's bound method, and with it
    the model and the KV cache)."""
    import threading
    import weakref

    from engine import LLM, SamplingParams

    def dropped(**kwargs):
        llm = LLM("tiny-gpt2", **kwargs)
        llm.generate(["hello"], SamplingParams(max_tokens=3), use_tqdm=False)
        return weakref.ref(llm.llm_engine.engine_core.engine_core)

    before = set(threading.enumerate())
    refs = [dropped(async_scheduling=True), dropped(async_scheduling=False)]
    gc.unfreeze()
    gc.collect()
    assert [r() for r in refs] == [None, None]
    for thread in set(threading.enumerate()) - before:  # the executor thread ends with its executor
        thread.join(30)
        assert not thread.is_alive(), thread.name


def test_the_cuda_kv_budget_is_measured_after_dropped_engines_are_freed(monkeypatch):
    """On CUDA the KV-cache budget is what the driver reports free. An LLM dropped without shutdown() is a
    cycle in the heap its LLM() froze, still holding its KV cache, and torch's allocator keeps what it freed:
    num_blocks_for thaws and collects the heap, and empties torch's cache, before it asks the driver."""
    import weakref

    import torch

    from engine.config import CacheConfig
    from engine.core.kv_cache_utils import num_blocks_for
    from engine.model_executor.model_loader import read_config, resolve

    class Engine:  # stands for an engine dropped without shutdown(): a cycle, frozen
        pass

    dropped = Engine()
    dropped.me = dropped
    freed = weakref.ref(dropped)
    del dropped
    gc.freeze()
    asked = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: asked.append("empty_cache"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def mem_get_info(device=None):
        asked.append(freed() is None)
        return 8 << 30, 16 << 30  # free, total

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
    arch = read_config(resolve("tiny-gpt2"))
    n, why = num_blocks_for(CacheConfig(gpu_memory_utilization=0.75), arch, torch.float16, torch.device("cuda"))
    assert asked == ["empty_cache", True]  # the cache emptied, then the driver asked with the engine gone
    assert "8589934592 already in use" in why and n > 2
