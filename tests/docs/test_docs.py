"""Documents that run: every ```bash and ```python block of README.md and docs/*.md is executed,
one test per block, in document order (tests/docs/drivers.py says how each kind of command is
driven). A block marked `<!-- doc-test: skip: REASON -->` is reported as skipped, with its reason.
A renamed command, flag, endpoint or attribute fails here before a reader meets it."""
from __future__ import annotations

import contextlib
import shutil

import pytest

from tests.docs.drivers import BIN, Runner, shared_server
from tests.docs.markdown import DOCUMENTS, MARKER, all_blocks, blocks, logical_lines, strip_comment

BLOCKS = all_blocks()

pytestmark = [
    pytest.mark.skipif(not (BIN / "vllm-trace").exists(), reason="needs the checkout's .venv (make setup)"),
    pytest.mark.skipif(shutil.which("tmux") is None or shutil.which("curl") is None,
                       reason="needs tmux and curl (apt-get install -y tmux curl)"),
]


@pytest.fixture(scope="module")
def runners(tmp_path_factory):
    """One Runner (working folder) per document, and one shared server, for the whole module."""
    with contextlib.ExitStack() as stack:
        url = shared_server(stack)
        made = {}

        def runner(path) -> Runner:
            if path not in made:
                made[path] = Runner(tmp_path_factory.mktemp(path.stem), url)
                stack.callback(made[path].close)
            return made[path]
        yield runner


@pytest.mark.parametrize("block", BLOCKS, ids=[b.name for b in BLOCKS])
def test_documented_block_runs(block, runners):
    if block.skip_reason is not None:
        assert block.skip_reason, f"{block.name}: a skipped block says why"
        pytest.skip(block.skip_reason)
    assert not block.marker, f"{block.name}: unknown doc-test marker {block.marker!r} (only 'skip: REASON')"
    runner = runners(block.path)
    if block.language == "python":
        runner.run_python(block.text)
    else:
        runner.run_bash(block.commands)


# ---- the collector itself: cheap, no server ---------------------------------------------------
def test_every_document_has_runnable_blocks():
    names = {b.path.name for b in BLOCKS}
    assert {"README.md", "user-guide.md", "lessons.md"} <= names and len(DOCUMENTS) >= 5


def test_blocks_markers_and_commands_are_read_as_a_reader_reads_them(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text("text\n\n<!-- doc-test: skip: needs\na browser -->\n```bash\nA=1\ncurl x \\\n  -d '{\"a\": 1}'"
                   "   # post\n```\n\n```\nnot run\n```\n```python\nprint(1)\n```\n")
    found = blocks(doc)
    assert [(b.line, b.language, b.skip_reason) for b in found] == [(5, "bash", "needs a browser"),
                                                                     (14, "python", None)]
    assert [c.argv for c in found[0].commands] == [["A=1"], ["curl", "x", "-d", '{"a": 1}']]
    assert found[0].commands[0].is_assignment and not found[0].commands[1].is_assignment
    assert logical_lines("a \\\n b\n\nc\n") == ["a   b", "c"]
    assert strip_comment("curl 'x#y' # z") == "curl 'x#y'" and strip_comment("a#b") == "a#b"
    assert MARKER.match("<!-- doc-test: skip: why -->").group(1) == "skip: why"
