"""`make setup` (what `make demo` and `make test` run first) on a fresh clone, with a stand-in for
Python whose pip and uv print what real ones print: no network, no real install. It shows progress
(a silent minute reads as a hang), installs uv with pip and then torch first with uv, passes pip's
find-links on to uv, stops at a failed install, and does nothing the second time. And the test targets:
make test leaves the tests marked slow to make test-slow, CI runs both, and every test file keeps one in make test."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FAKE_PYTHON = """#!/bin/bash
# "python -m venv DIR": DIR/bin/pip and DIR/bin/uv, which print what they print (nothing with --quiet),
# log their arguments and exit $PIP_STATUS; and DIR/bin/python, which logs its arguments (the bytecode step)
[ "$1 $2" = "-m venv" ] || exit 3
sleep "${VENV_SECONDS:-0}"  # as ensurepip is, silent
mkdir -p "$3/bin"
for tool in pip uv python; do
cat > "$3/bin/$tool" <<'PIP'
#!/bin/bash
echo "$(basename "$0") $*" >> "$(dirname "$0")/pip.log"
[ "$(basename "$0")" = python ] && exit 0
for a in "$@"; do [ "$a" = "--quiet" ] && exit "${PIP_STATUS:-0}"; done
if [ "$(basename "$0")" = pip ]; then
  echo "Requirement already satisfied: setuptools"; echo "Collecting ${@: -1}"; echo "Successfully installed ${@: -1}"
else
  echo "Resolved 1 package in 5ms" >&2; echo " + ${@: -1}" >&2
fi
exit "${PIP_STATUS:-0}"
PIP
chmod +x "$3/bin/$tool"
done
"""
pytestmark = pytest.mark.skipif(shutil.which("make") is None or shutil.which("bash") is None,
                                reason="needs make and bash")


def make_setup(tmp_path: Path, **env) -> subprocess.CompletedProcess:
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    if not (tmp_path / "pyproject.toml").exists():  # (rewritten, it would be newer than the venv: a rebuild)
        (tmp_path / "pyproject.toml").write_text("")
    return subprocess.run(["make", "-C", str(tmp_path), "-f", str(ROOT / "Makefile"), "--no-print-directory",
                           "setup", f"PYTHON={fake}"], capture_output=True, text=True, env={"PATH": "/usr/bin:/bin",
                                                                                              **env})


@pytest.mark.slow
def test_setup_shows_progress_torch_first_and_is_idempotent(tmp_path):
    first = make_setup(tmp_path, PIP_FIND_LINKS="/opt/wheels")
    assert first.returncode == 0, first.stderr
    out = first.stdout
    assert "==> setting up .venv" in out and "[1/3] uv" in out and "[2/3] torch==2.13.0" in out
    assert "[3/3] vllm-trace" in out
    assert "Collecting uv>=0.13.9" in out and "Requirement already satisfied: setuptools" not in out  # pip's progress
    assert " + torch==2.13.0" in first.stderr and " + .[dev]" in first.stderr  # uv's, not hidden
    installs = (tmp_path / ".venv/bin/pip.log").read_text().splitlines()
    assert installs[0].startswith("pip install") and installs[0].endswith(" uv>=0.13.9")
    # pip's find-links, passed on; bytecode compiled at install (no process compiles torch when it starts)
    uv = "uv pip install --python .venv/bin/python --compile-bytecode --find-links /opt/wheels"
    assert installs[1] == f"{uv} torch==2.13.0" and installs[2] == f"{uv} -e .[dev]"
    assert installs[3] == "python -m compileall -q engine kernels tracer lessons benchmarks"  # ours too
    again = make_setup(tmp_path)
    assert again.returncode == 0 and "==>" not in again.stdout
    assert len((tmp_path / ".venv/bin/pip.log").read_text().splitlines()) == 4  # nothing installed again


def test_setup_stops_when_an_install_fails(tmp_path):
    failed = make_setup(tmp_path, PIP_STATUS="1")
    assert failed.returncode != 0 and "[2/3]" not in failed.stdout
    assert not (tmp_path / ".venv/bin/vllm-trace").exists()  # so the next make tries again


@pytest.mark.slow
def test_a_silent_step_still_prints_a_line_every_few_seconds(tmp_path):
    """`python -m venv` installs pip without a word (40 s on a busy 2-core machine)."""
    slow = make_setup(tmp_path, VENV_SECONDS="7")
    assert slow.returncode == 0, slow.stderr
    venv_part = slow.stdout.split("-m venv .venv", 1)[1].split("==> [1/3]", 1)[0]
    assert re.search(r"^    \.\.\. \d+ s$", venv_part, re.M)  # a tick every 3 s until the venv is made


def make_dry_run(tmp_path: Path, target: str) -> str:
    """The commands `make TARGET` runs once set up (make -n: nothing runs)."""
    (tmp_path / "pyproject.toml").write_text("")
    (tmp_path / ".venv/bin").mkdir(parents=True, exist_ok=True)
    (tmp_path / ".venv/bin/vllm-trace").write_text("")  # newer than pyproject.toml: set up already
    r = subprocess.run(["make", "-n", "-C", str(tmp_path), "-f", str(ROOT / "Makefile"), "--no-print-directory",
                        target], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_make_test_leaves_the_slow_tests_to_make_test_slow_and_ci_runs_both(tmp_path):
    assert make_dry_run(tmp_path, "test").strip() == '.venv/bin/python -m pytest --ignore=tests/docs -m "not slow"'
    assert make_dry_run(tmp_path, "test-slow").strip() == ".venv/bin/python -m pytest --ignore=tests/docs -m slow"
    assert 'markers = ["slow: ' in (ROOT / "pyproject.toml").read_text()  # registered: a typo'd mark is a warning
    steps = [line.split("#")[0].strip() for line in (ROOT / ".ci/run").read_text().splitlines()]
    makes = [s for s in steps if s.startswith("make ")]
    assert makes[:4] == ["make lint", "make test", "make test-docs", "make test-slow"], makes
    assert steps.index("make test-slow") < next(i for i, s in enumerate(steps) if "make parity" in s)


def test_every_test_file_keeps_a_test_in_make_test():
    """A file whose every test is marked slow would leave its module untested by make test; a whole file is slow
    only where it says so (pytestmark = pytest.mark.slow, as the fuzzer does)."""
    import ast

    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        tree = ast.parse(path.read_text())
        marks = [ast.unparse(n.value) for n in tree.body if isinstance(n, ast.Assign)
                 and ast.unparse(n.targets[0]) == "pytestmark"]
        if any("mark.slow" in m for m in marks):
            continue
        tests = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                 and n.name.startswith("test")]
        fast = [n for n in tests if "pytest.mark.slow" not in map(ast.unparse, n.decorator_list)]
        assert fast or not tests, f"{path.relative_to(ROOT)}: every test is marked slow; keep one in make test"
