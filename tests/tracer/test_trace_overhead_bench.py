"""The trace-overhead benchmark's measuring code, on a tiny workload: every mode runs the same
schedule (its per-step comparison depends on it) and the helper threads' work is counted."""
from benchmarks.trace_overhead import MODES, run_lockstep
from benchmarks.workload import make_workload


def test_every_mode_runs_the_same_steps_and_tokens(tmp_path):
    work = make_workload(3, seed=2)
    runs = run_lockstep(MODES, "tiny-gpt2", work, tmp_path, rotate=1)
    assert set(runs) == set(MODES)
    assert len({len(steps) for steps, _, _ in runs.values()}) == 1
    assert {tokens for _, _, tokens in runs.values()} == {sum(p.max_tokens for _, p in work)}
    assert all(s > 0 for steps, _, _ in runs.values() for s in steps)
    assert runs["bypassed"][1] == runs["off"][1] == 0 and runs["on"][1] > 0  # the recorder's flush and thread
    assert (tmp_path / "on.jsonl").stat().st_size > 0
