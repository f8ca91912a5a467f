"""The runnable parts of the documents: every fenced ```bash and ```python block of README.md and
docs/*.md, with its commands (a bash block's logical lines, `\\` continuations joined) and the
marker on the line before it, if any: `<!-- doc-test: skip: REASON -->` leaves a block out, and
says why, for what a test cannot do (a second machine, the Hugging Face hub)."""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\s*$")
MARKER = re.compile(r"^<!--\s*doc-test:\s*(.*?)\s*-->$", re.S)


@dataclass
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    language: str
    text: str
    marker: str = ""  # what the <!-- doc-test: ... --> before it says

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def skip_reason(self) -> str | None:
        return self.marker.removeprefix("skip:").strip() if self.marker.startswith("skip:") else None

    @property
    def commands(self) -> list[Command]:
        return [Command(line) for line in logical_lines(self.text)] if self.language == "bash" else []


@dataclass
class Command:
    text: str
    code: str = field(init=False)  # without its comment
    argv: list[str] = field(init=False)

    def __post_init__(self):
        self.code = strip_comment(self.text)
        self.argv = shlex.split(self.code)

    @property
    def program(self) -> str:
        return Path(self.argv[0]).name if self.argv else ""

    @property
    def subcommand(self) -> str:
        """`serve` for `.venv/bin/vllm-trace serve ...`; "" for other programs."""
        return self.argv[1] if self.program == "vllm-trace" and len(self.argv) > 1 else ""

    @property
    def is_assignment(self) -> bool:
        return len(self.argv) == 1 and re.fullmatch(r"[A-Za-z_]\w*=.*", self.argv[0]) is not None

    def option(self, name: str) -> str | None:
        """The value after `name`, or None."""
        return self.argv[self.argv.index(name) + 1] if name in self.argv[:-1] else None


def blocks(path: Path) -> list[Block]:
    found, lines, i = [], path.read_text().splitlines(), 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        marker = MARKER.match(comment_before(lines, i))
        if fence.group(1) in ("bash", "python"):
            found.append(Block(path, i + 1, fence.group(1), "\n".join(lines[i + 1:end]) + "\n",
                               marker.group(1) if marker else ""))
        i = end + 1
    return found


def comment_before(lines: list[str], i: int) -> str:
    """The HTML comment that ends on the last non-blank line before line i, joined into one line."""
    j = next((j for j in range(i - 1, -1, -1) if lines[j].strip()), -1)
    if j < 0 or not lines[j].rstrip().endswith("-->"):
        return ""
    start = next((k for k in range(j, -1, -1) if lines[k].lstrip().startswith("<!--")), j)
    return " ".join(line.strip() for line in lines[start:j + 1])


def all_blocks() -> list[Block]:
    return [b for path in DOCUMENTS for b in blocks(path)]


def logical_lines(text: str) -> list[str]:
    """A bash block's commands: continuation lines joined, blank lines left out."""
    out, cur = [], ""
    for line in text.splitlines():
        if line.rstrip().endswith("\\"):
            cur += line.rstrip()[:-1] + " "
            continue
        cur += line
        if cur.strip():
            out.append(cur.strip())
        cur = ""
    return out


def strip_comment(line: str) -> str:
    """The line up to its `#` comment (a `#` inside quotes, or inside a word, is not one)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()
