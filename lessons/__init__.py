"""Runnable lessons, one concept each, on the real engine. `vllm-trace lesson` lists them."""
from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).parent


@dataclass
class LessonInfo:
    number: int
    name: str  # e.g. "paged_kv_cache"
    module: str  # e.g. "lessons.05_paged_kv_cache"
    title: str
    summary: str
    path: Path


def discover() -> list[LessonInfo]:
    out = []
    for path in sorted(HERE.glob("[0-9][0-9]_*.py")):
        m = re.match(r"(\d\d)_(.+)\.py$", path.name)
        module = importlib.import_module(f"lessons.{path.stem}")
        out.append(LessonInfo(int(m.group(1)), m.group(2), module.__name__, module.TITLE, module.SUMMARY, path))
    return out


def find(key: str) -> LessonInfo:
    """By number ("5", "05") or by name ("paged_kv_cache", "paged-kv-cache", a unique prefix)."""
    lessons = discover()
    key_n = key.replace("-", "_").lower()
    for info in lessons:
        if key.isdigit() and int(key) == info.number:
            return info
    matches = [i for i in lessons if i.name.startswith(key_n)]
    if len(matches) == 1:
        return matches[0]
    names = ", ".join(f"{i.number:02d} {i.name}" for i in lessons)
    raise ValueError(f"no single lesson matches {key!r}; lessons: {names}")
