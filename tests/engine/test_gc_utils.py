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


def test_an_llm_dropped_without_shutdown_is_freed_by_the_next_collection():
    """LLM() freezes the heap (as vLLM's EngineCore does), and a frozen cycle is never collected: an LLM
    dropped without shutdown() shuts its engine down and thaws the heap, so a second LLM in the same
    process finds the device's memory free. Nothing else holds the engine, not even the executor thread
    of async scheduling waiting for its next call."""
    import threading
    import weakref

    from engine import LLM, SamplingParams

    def dropped(**kwargs):
        llm = LLM("tiny-gpt2", **kwargs)
        llm.generate(["hello"], SamplingParams(max_tokens=3), use_tqdm=False)
        return weakref.ref(llm.llm_engine.engine_core.engine_core)

    before = set(threading.enumerate())
    refs = [dropped(async_scheduling=True), dropped(async_scheduling=False)]
    gc.collect()
    assert [r() for r in refs] == [None, None]
    for thread in set(threading.enumerate()) - before:  # the executor thread ends with its executor
        thread.join(30)
        assert not thread.is_alive(), thread.name
