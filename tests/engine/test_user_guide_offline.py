"""The user guide's offline example runs as written, the engine core in this process or its own."""
import re
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.outputs import EngineStats

GUIDE = Path(__file__).parents[2] / "docs" / "user-guide.md"


def test_the_offline_example_runs_as_written(capsys):
    section = GUIDE.read_text().split("## Offline: `LLM`", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    namespace: dict = {}
    exec(compile(code, str(GUIDE), "exec"), namespace)
    namespace["llm"].llm_engine.shutdown()
    assert "num_free_blocks=" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.parametrize("multiprocess", [False, True])
def test_stats_counts_the_steps_run(multiprocess):
    llm = LLM("tiny-gpt2", multiprocess=multiprocess)
    try:
        llm.generate(["Hello"], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), use_tqdm=False)
        stats = llm.llm_engine.stats()
        assert isinstance(stats, EngineStats)
        # three steps, one token each; async scheduling (the default) may also have scheduled an empty
        # fourth while the third token was in flight, as vLLM's step_with_batch_queue does
        assert stats.step in (3, 4) and (stats.num_waiting, stats.num_running) == (0, 0)
        assert stats.num_free_blocks == stats.num_total_blocks > 0
    finally:
        llm.llm_engine.shutdown()
