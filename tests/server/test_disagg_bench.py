"""benchmarks/disagg.py without servers: the mixed load it sends, and its per-class figures and table."""
import argparse

from benchmarks.disagg import LONG, SHORT, summary, table, workload


def test_the_mixed_load_is_seeded_and_has_both_classes():
    work = workload(0, 3, 2)
    assert [(kind, len(prompt), n) for kind, prompt, n in work] == [("short", *SHORT)] * 3 + [("long", *LONG)] * 2
    assert work == workload(0, 3, 2) and work != workload(1, 3, 2)


def test_figures_are_per_class_and_tpot_leaves_the_first_token_out():
    run = {"short": {"ttft": [0.1, 0.3], "itl": [0.01, 0.02, 0.5], "e2e": [1.1, 1.3], "tpot": [0.01, 0.02]},
           "long": {"ttft": [0.4, 0.6, 0.8], "itl": [0.01], "e2e": [1.0, 1.0, 1.0], "tpot": [0.1]}}
    s = summary(run)
    assert (s["long_ttft"], s["short_ttft"], s["short_itl"], s["short_itl_max"]) == (600, 200, 20, 500)
    assert abs(s["short_tpot"] - 15) < 1e-9
    rows = dict(s, cpu_s=2.0, load=(1.0, 2.0))
    args = argparse.Namespace(short=3, long=2, gap=0.25, reps=1)
    lines = table({"colocated": [rows], "disaggregated": [rows]}, args).splitlines()
    assert lines[0].startswith("| setup | long: TTFT ms |") and lines[2].startswith("| colocated | 600 | 200 |")
    assert "load average 1.0-2.0" in lines[-1]
