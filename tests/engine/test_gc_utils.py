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
