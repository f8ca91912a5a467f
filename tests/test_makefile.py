"""`make setup` (what `make demo` and `make test` run first) on a fresh clone, with a stand-in for
Python whose pip prints what a real one prints: no network, no real install. It shows progress
(it printed nothing for the minute and a half pip took), installs torch first, stops at a failed
install, and does nothing the second time."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FAKE_PYTHON = """#!/bin/bash
# "python -m venv DIR": DIR/bin/pip, which prints what pip prints (nothing with --quiet) and exits $PIP_STATUS
[ "$1 $2" = "-m venv" ] || exit 3
mkdir -p "$3/bin"
cat > "$3/bin/pip" <<'PIP'
#!/bin/bash
echo "$*" >> "$(dirname "$0")/pip.log"
for a in "$@"; do [ "$a" = "--quiet" ] && exit "${PIP_STATUS:-0}"; done
echo "Requirement already satisfied: setuptools"
echo "Collecting ${@: -1}"
echo "Successfully installed ${@: -1}"
exit "${PIP_STATUS:-0}"
PIP
chmod +x "$3/bin/pip"
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


def test_setup_shows_progress_torch_first_and_is_idempotent(tmp_path):
    first = make_setup(tmp_path)
    assert first.returncode == 0, first.stderr
    out = first.stdout
    assert "==> setting up .venv" in out and "[1/2] torch==2.13.0" in out and "[2/2] vllm-trace" in out
    assert "Collecting torch==2.13.0" in out and "Collecting .[dev]" in out  # pip's own progress, not hidden
    assert "Requirement already satisfied: setuptools" not in out
    installs = (tmp_path / ".venv/bin/pip.log").read_text().splitlines()
    assert installs[0].endswith("torch==2.13.0") and installs[1].endswith("-e .[dev]")
    again = make_setup(tmp_path)
    assert again.returncode == 0 and "==>" not in again.stdout
    assert len((tmp_path / ".venv/bin/pip.log").read_text().splitlines()) == 2  # nothing installed again


def test_setup_stops_when_an_install_fails(tmp_path):
    failed = make_setup(tmp_path, PIP_STATUS="1")
    assert failed.returncode != 0 and "[2/2]" not in failed.stdout
    assert not (tmp_path / ".venv/bin/vllm-trace").exists()  # so the next make tries again
