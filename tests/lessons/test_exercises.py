"""Graded exercises: the untouched stub fails cleanly, the reference solution passes inside the
real engine, and a deliberately wrong solution fails, naming the check it broke."""
import io
import subprocess
import sys

import pytest
from rich.console import Console

from lessons import exercises

EXERCISES = exercises.discover()
# (exercise name, a line of the reference solution, the wrong line put in its place, words of the failed check)
WRONG = {
    "slot_mapping": ("slots.append(table[pos // block_size] * block_size + pos % block_size)", "slots.append(pos)",
                     "every token's slot is block_table[pos // 16]"),
    "allocate_blocks": ("        del pool.free_block_queue[b]", "        pass",
                        "hits on cached-but-free blocks take them out of the free queue"),
    "online_softmax": ("alpha = torch.exp(m - m_new)", "alpha = torch.tensor(1.0)",
                       "it equals softmax(q·K × scale)·V"),
    "acceptance": ("        return kept + [target_argmax[j] if greedy else recovered[j]]",
                   "        return kept + [target_argmax[j]]",
                   "rejects the second, replaced by the recovered token"),
    "route_the_tokens": ("        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)",
                         "        pass", "each token's two weights sum to 1 (norm_topk_prob)"),
}


def grade(info, source: str, tmp_path) -> tuple[int, str]:
    path = tmp_path / info.stub_file
    path.write_text(source)
    out = io.StringIO()
    rc = exercises.grade(info, path, Console(file=out, width=300))
    return rc, out.getvalue()


@pytest.mark.slow
def test_at_least_three_exercises_listed_one_line_each():
    r = subprocess.run([sys.executable, "-m", "tracer.cli", "exercise"], capture_output=True, text=True)
    lines = r.stdout.splitlines()
    assert r.returncode == 0 and len(EXERCISES) >= 3 and len(lines) == len(EXERCISES) + 1
    assert all(len(line) <= 80 for line in lines) and all(i.name in r.stdout for i in EXERCISES)


@pytest.mark.parametrize("info", EXERCISES, ids=[i.name for i in EXERCISES])
def test_stub_fails_cleanly_solution_passes_wrong_fails(info, tmp_path):
    stub = info.stub()
    assert f"def {info.module.FUNCTION}(" in stub and "raise NotImplementedError" in stub
    rc, out = grade(info, stub, tmp_path)
    assert rc == 1 and "untouched stub" in out and "Traceback" not in out, out

    rc, out = grade(info, info.solution(), tmp_path)
    assert rc == 0 and "All" in out and "checks passed" in out, out
    assert "✗" not in out

    right, wrong, claim = WRONG[info.name]
    assert right in info.solution()
    rc, out = grade(info, info.solution().replace(right, wrong), tmp_path)
    assert rc == 1 and "check failed" in out and claim in out, out


def test_route_the_tokens_fails_on_wrong_blocks_saying_what_they_should_hold(tmp_path):
    """Two more wrong solutions of exercise 5, each failing on vLLM's example before the engine runs:
    runs not padded to whole blocks (the row count falls short), and runs padded with a real pair's
    id instead of T·top_k (the block's rows are named against the expected ones)."""
    info = exercises.find("route_the_tokens")
    right = "        pairs += [num_pairs] * (-len(pairs) % block_size)"
    assert right in info.solution()
    rc, out = grade(info, info.solution().replace(right, "        pass"), tmp_path)
    assert rc == 1 and "check failed: vLLM's example: sorted_token_ids" in out, out
    assert "num_tokens_post_padded is 12, expected 16" in out and "multiple of 4" in out, out
    rc, out = grade(info, info.solution().replace(right, "        pairs += [0] * (-len(pairs) % block_size)"), tmp_path)
    assert rc == 1 and "check failed: vLLM's example: sorted_token_ids" in out, out
    assert "block 0: got expert 0 with rows [2, 5, 8, 0], expected expert 0 with rows [2, 5, 8, 12]" in out, out


@pytest.mark.slow
def test_cli_start_then_check_the_stub_and_bad_input(tmp_path, monkeypatch, capsys):
    from tracer.cli import main

    def run(*a):
        """`vllm-trace exercise ARGS` through the CLI's main here: each new interpreter costs seconds of
        imports (the one subprocess below covers the real entry point); a traceback would fail the test."""
        code = main(["exercise", *a])
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(a, code, out, err)

    monkeypatch.chdir(tmp_path)
    r = subprocess.run([sys.executable, "-m", "tracer.cli", "exercise", "1", "--start"],
                       capture_output=True, text=True, cwd=tmp_path)
    stub = tmp_path / "exercise_01_slot_mapping.py"
    assert r.returncode == 0 and stub.is_file()
    r = run("1", "--start")
    assert r.returncode == 2 and "already exists" in r.stderr  # never overwrites the learner's work
    r = run("1", "--check", stub.name)
    assert r.returncode == 1 and "untouched stub" in r.stdout and "Traceback" not in r.stdout + r.stderr
    r = run("1", "--check", "missing.py")
    assert r.returncode == 2 and "no such file" in r.stderr and "Traceback" not in r.stderr
    (tmp_path / "broken.py").write_text("def slot_mapping(:\n")
    r = run("1", "--check", "broken.py")
    assert r.returncode == 2 and "does not load" in r.stderr and "Traceback" not in r.stderr
    r = run("99")
    assert r.returncode == 2 and "no single exercise matches" in r.stderr
    r = run("slot", "--solution")
    assert r.returncode == 0 and "def slot_mapping(" in r.stdout
