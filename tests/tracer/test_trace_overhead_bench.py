"""The trace-overhead benchmark's measuring code, on a tiny workload: every (async setting, mode) runs
whole runs of the same workload (its tokens checked), interleaved, and the `on` runs record a trace."""
from benchmarks.trace_overhead import ASYNC, MODES, run_interleaved
from benchmarks.workload import make_workload


def test_every_async_setting_and_mode_runs_the_whole_workload(tmp_path):
    work = make_workload(2, seed=2, output_len=(2, 4))
    seconds = run_interleaved("tiny-gpt2", work, 2, tmp_path)
    assert set(seconds) == {(a, m) for a in ASYNC for m in MODES}
    assert all(len(s) == 2 and min(s) > 0 for s in seconds.values())
    assert (tmp_path / "on.jsonl").stat().st_size > 0
