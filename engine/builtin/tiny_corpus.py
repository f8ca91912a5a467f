"""The English text ``tiny-gpt2`` is trained on: documentation that ships with Python and with
permissively licensed packages, so the corpus is available offline and may be redistributed
inside a model trained on it.

Sources, in order (each a list of documents; a document ends with ``<|endoftext|>`` when the
training script joins them):

- CPython's ``pydoc_data.topics``: the language reference and library topics ``help()`` shows
  (PSF License). One document per topic.
- The standard library's docstrings (PSF License). One document per module: its docstring,
  then each class's and function's, in source order.
- The docstrings and the package description (README, from the installed METADATA) of the
  packages in ``PACKAGES``, each under the MIT, BSD or Apache-2.0 licence its metadata states.
  A package whose installed metadata names another licence is skipped.

Docstrings are cut into paragraphs, and only prose paragraphs are kept (not doctest lines, code,
tables, parameter lists or reST directives), each once: libraries copy docstrings widely.
Everything is read from files in a fixed (sorted) order, so one Python installation always gives
the same corpus; ``corpus_sha256`` is printed and recorded in the model card.
"""
from __future__ import annotations

import ast
import email
import hashlib
import importlib.metadata
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path

EOT = "<|endoftext|>"

# (package, distribution): docstrings of the package's modules and the distribution's README.
PACKAGES = [
    ("numpy", "numpy"), ("networkx", "networkx"), ("click", "click"), ("rich", "rich"),
    ("textual", "textual"), ("pydantic", "pydantic"), ("fastapi", "fastapi"), ("starlette", "starlette"),
    ("requests", "requests"), ("jinja2", "jinja2"), ("werkzeug", "werkzeug"), ("pygments", "pygments"),
    ("torch", "torch"), ("transformers", "transformers"), ("mpmath", "mpmath"), ("typer", "typer"),
    ("anyio", "anyio"), ("httpx", "httpx"), ("urllib3", "urllib3"), ("setuptools", "setuptools"),
    ("huggingface_hub", "huggingface_hub"), ("sympy", "sympy"), ("fsspec", "fsspec"),
    ("packaging", "packaging"), ("idna", "idna"), ("uvicorn", "uvicorn"), ("filelock", "filelock"),
    ("platformdirs", "platformdirs"), ("pluggy", "pluggy"), ("sortedcontainers", "sortedcontainers"),
]
PERMISSIVE = re.compile(r"\b(MIT|BSD|Apache)\b", re.I)
# Directories whose files are tests, vendored third-party code or generated tables, not prose.
SKIP_DIRS = {"test", "tests", "testing", "_vendor", "vendor", "site-packages", "idle_test", "lib2to3",
             "__pycache__", "benchmarks", "_distutils"}


@dataclass
class Source:
    """One origin of documents, as the model card lists it."""
    name: str
    licence: str
    documents: list[str]


def _is_prose(par: str) -> bool:
    lines = par.splitlines()
    if len(par) < 40 or len(par.split()) < 7:
        return False
    if any(ln.lstrip().startswith((">>>", "...", "..", "$ ", "%", "|", "+-", "==", "--", "::", "#"))
           for ln in lines):
        return False
    if re.search(r"^\s*\w[\w, ]*\s:\s", par, re.M):  # numpydoc "name : type"
        return False
    if re.match(r"^(Args|Arguments|Parameters|Params|Returns?|Yields?|Raises|Examples?|Notes?|Attributes|"
                r"See Also|References|Usage|Warnings?|Keyword Arguments|Kwargs|Shape|Inputs|Outputs)s?:",
                lines[0].strip()):
        return False
    letters = sum(c.isalpha() or c in " ,.;:'()-" for c in par)
    if letters < 0.9 * len(par):  # symbols, math, markup
        return False
    return par.count("`") <= 8 and "\\" not in par and "http" not in par


def _paragraphs(text: str, seen: set[str]) -> list[str]:
    out = []
    for par in re.split(r"\n\s*\n", text.strip()):
        if any(ln[:1].isspace() for ln in par.splitlines()):  # indented: code, parameter bodies, quotes
            continue
        par = " ".join(par.split())  # reflow wrapped lines
        par = re.sub(r":[\w:.]+:`~?([^`]+)`", r"\1", par)  # reST roles (:meth:`x`) -> x
        par = re.sub(r"``([^`]+)``", r"\1", par)
        if _is_prose(par) and par not in seen:
            seen.add(par)
            out.append(par)
    return out


def _docstrings(path: Path) -> list[str]:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True)
            if doc:
                out.append((getattr(node, "lineno", 0), doc))
    return [d for _, d in sorted(out, key=lambda x: x[0])]


def _module_documents(root: Path, seen: set[str]) -> list[str]:
    docs = []
    for path in sorted(root.rglob("*.py")):
        if SKIP_DIRS & set(path.relative_to(root).parts[:-1]) or path.name.startswith("test_"):
            continue
        pars = [p for doc in _docstrings(path) for p in _paragraphs(doc, seen)]
        if pars:
            docs.append("\n\n".join(pars))
    return docs


def pydoc_topics() -> Source:
    from pydoc_data.topics import topics

    seen: set[str] = set()
    docs = []
    for name in sorted(topics):
        text = topics[name].strip()
        # topics are plain text, code blocks indented: keep them as they are (real docs), only
        # drop the runs of blank lines
        docs.append(re.sub(r"\n{3,}", "\n\n", text))
        seen.add(name)
    return Source("CPython pydoc_data.topics", "PSF-2.0", docs)


def stdlib_docstrings(seen: set[str]) -> Source:
    root = Path(sysconfig.get_paths()["stdlib"])
    return Source("CPython standard library docstrings", "PSF-2.0", _module_documents(root, seen))


def package_sources(seen: set[str]) -> list[Source]:
    out = []
    for package, dist in PACKAGES:
        try:
            meta = importlib.metadata.metadata(dist)
            files = importlib.metadata.distribution(dist).locate_file("")
        except importlib.metadata.PackageNotFoundError:
            continue
        licence = meta.get("License-Expression") or meta.get("License") or ""
        if len(licence) > 60 or not licence:
            licence = next((c.split("::")[-1].strip() for c in meta.get_all("Classifier") or []
                            if c.startswith("License ::")), licence[:60])
        if not PERMISSIVE.search(licence):
            continue
        root = Path(str(files)) / package
        if not root.is_dir():
            continue
        docs = _module_documents(root, seen)
        readme = _readme(meta, seen)
        if readme:
            docs.insert(0, readme)
        out.append(Source(f"{dist} {meta['Version']}", licence, docs))
    return out


def _readme(meta: email.message.Message, seen: set[str]) -> str:
    body = meta.get_payload() or ""
    pars = []
    for par in re.split(r"\n\s*\n", body):
        par = re.sub(r"\[([^\]]+)\]\([^)]+\)", r"\1", par)  # markdown links -> their text
        par = re.sub(r"[*_]{1,2}([^*_]+)[*_]{1,2}", r"\1", par)
        pars += _paragraphs(par, seen)
    return "\n\n".join(pars)


def build() -> list[Source]:
    seen: set[str] = set()
    return [pydoc_topics(), stdlib_docstrings(seen), *package_sources(seen)]


def corpus_sha256(sources: list[Source]) -> str:
    h = hashlib.sha256()
    for s in sources:
        for d in s.documents:
            h.update(d.encode("utf-8") + EOT.encode())
    return h.hexdigest()


if __name__ == "__main__":
    srcs = build()
    for s in srcs:
        print(f"{s.name:40s} {s.licence:30.30s} {len(s.documents):6d} docs {sum(map(len, s.documents)):10,d} chars")
    print("total", sum(sum(map(len, s.documents)) for s in srcs), corpus_sha256(srcs))
