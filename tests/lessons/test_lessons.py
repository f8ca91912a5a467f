"""Every lesson runs straight through (--no-pause) on the real engine and its checks pass;
and a lesson fails when the behaviour it teaches is broken on purpose."""
import importlib
import subprocess
import sys

import pytest

import lessons
from lessons.cli import main

LESSONS = lessons.discover()
# lessons that start worker or core processes (8-29 s each on 2 cores): make test-slow; the engine tests of
# tensor/expert parallelism, the core process and speculative decoding keep those features in make test
SLOW = {"two_processes", "tensor_parallelism", "mixture_of_experts", "speculative_decoding"}


@pytest.mark.parametrize("info", [pytest.param(i, marks=pytest.mark.slow) if i.name in SLOW else i for i in LESSONS],
                         ids=[f"{i.number:02d}_{i.name}" for i in LESSONS])
def test_lesson_runs_and_its_checks_pass(info, capsys):
    assert main(vars(importlib.import_module(info.module)), ["--no-pause"]) == 0, capsys.readouterr().out[-3000:]
    out = capsys.readouterr().out
    assert "✓" in out
    if info.name == "paged_kv_cache":  # its tables, read from this same run (each lesson runs once here)
        _block_table_shows_positions_beside_the_token_ids(out)


def test_paged_kv_cache_lesson_fails_if_blocks_are_over_allocated(monkeypatch, capsys):
    """Break the KV-cache manager: every request gets one block more than it needs."""
    from engine.core.single_type_kv_cache_manager import SingleTypeKVCacheManager as Manager
    original = Manager.allocate_new_blocks
    monkeypatch.setattr(Manager, "allocate_new_blocks",  # every table one block longer than its tokens need
                        lambda self, request, num_tokens: original(self, request, num_tokens + self.block_size))
    module = importlib.import_module(lessons.find("paged_kv_cache").module)
    assert main(vars(module), ["--no-pause"]) == 1
    assert "the engine disagrees" in capsys.readouterr().out


def test_sliding_windows_lesson_fails_if_the_window_never_gives_blocks_back(monkeypatch, capsys):
    """Break the sliding-window manager: blocks the window has passed stay in the request's table."""
    from engine.core.single_type_kv_cache_manager import SlidingWindowManager

    monkeypatch.setattr(SlidingWindowManager, "remove_skipped_blocks", lambda self, request, num_computed_tokens: [])
    module = importlib.import_module(lessons.find("sliding_windows").module)
    assert main(vars(module), ["--no-pause"]) == 1
    assert "the engine disagrees" in capsys.readouterr().out


def test_lessons_are_listed_and_run_from_the_cli(capsys):
    from tracer.cli import main as cli

    def run(*args):  # `vllm-trace lesson ARGS` through the CLI's main here (a new interpreter costs seconds)
        code = cli(["lesson", *args])
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(args, code, out, err)

    r = run()
    assert r.returncode == 0 and "paged_kv_cache" in r.stdout
    lines = r.stdout.splitlines()  # not a terminal: a title, then one whole line per lesson (for grep)
    assert len(lines) == len(LESSONS) + 1
    assert [line[:2] for line in lines[1:]] == [f"{i.number:02d}" for i in LESSONS]
    assert all(line.endswith(f"{i.title}: {i.summary}") for line, i in zip(lines[1:], LESSONS))
    r = subprocess.run([sys.executable, "lessons/05_paged_kv_cache.py", "--no-pause"], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    r = run("no-such-lesson")
    assert r.returncode == 2 and "no single lesson matches" in r.stderr


def _block_table_shows_positions_beside_the_token_ids(out: str) -> None:
    """Lesson 5's prompt ids are 0, 1, 2, ...: its one "tokens" column read A's generated token id 12 as
    if it were position 12, in the block that holds position 48."""
    import re

    assert re.search(r"positions\s+┃\s+token ids there", out), out
    assert re.search(r"│ 3\s+│ \d+\s+│ 1/16\s+│ 48\s+│ \d+\s+│", out), out  # A's 4th block: position 48 only
    assert re.search(r"│ 1\s+│ \d+\s+│ 16/16\s+│ 16–31\s+│", out), out
