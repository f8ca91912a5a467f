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
