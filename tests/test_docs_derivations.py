"""The derivation pages (``docs/derivations/*.md``): one per functional pair, each complete.

Read as text (no Sphinx needed): every pair of the textbook tier has a page that includes its
forward, backward and JVP from the source file (``{literalinclude}`` with ``:pyobject:``, never
copied), every page is executed by the build (a MyST notebook with a ``gradcheck`` code cell) and
links the notebook section that covers it; every included object exists in its file.  The build
itself (``tests/test_docs_site.py``) then checks that the pages render, with warnings as errors.
"""

from __future__ import annotations

import ast
import functools
import pathlib
import re

import pytest

from npattn.functional import reference

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = sorted(p for p in (ROOT / "docs" / "derivations").glob("*.md") if p.name != "index.md")
INCLUDE = re.compile(r"```\{literalinclude\}\s+(\S+)\s*\n:pyobject:\s*(\S+)")


def _includes(page: pathlib.Path):
    """``(source file, object)`` of every ``literalinclude`` with ``:pyobject:`` in ``page``."""
    return [((page.parent / path).resolve(), obj) for path, obj in INCLUDE.findall(page.read_text())]


@functools.lru_cache(maxsize=None)
def _defined(source: pathlib.Path) -> frozenset:
    """The functions and classes of ``source``, methods as ``Class.method`` (each file parsed once:
    the pages include from a few large files, reference.py above all)."""
    names = set()
    for node in ast.parse(source.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        if isinstance(node, ast.ClassDef):
            names |= {f"{node.name}.{n.name}" for n in node.body if isinstance(n, ast.FunctionDef)}
    return frozenset(names)


def test_every_pair_has_its_page():
    included = {obj for page in PAGES for src, obj in _includes(page) if src.name == "reference.py"}
    pairs = [n for n in reference.__all__ if f"{n}_backward" in reference.__all__]
    assert len(pairs) >= 19, pairs
    missing = [f"{n}{part}" for n in pairs for part in ("", "_backward", "_jvp") if f"{n}{part}" not in included]
    assert not missing, f"pairs without a derivation page including them (docs/derivations/*.md): {missing}"


@pytest.mark.parametrize("page", PAGES, ids=[p.stem for p in PAGES])
def test_page_is_complete(page):
    text = page.read_text()
    front = text.split("---", 2)[1] if text.startswith("---") else ""
    executed = "file_format: mystnb" in front and 'execution_mode: "force"' in front
    assert executed, f"{page.name}: not executed by the build"
    cells = "".join(re.findall(r"```\{code-cell\} python\n(.*?)```", text, re.S))
    calls = cells.count("npattn.gradcheck(")
    assert calls >= 1, f"{page.name}: no gradcheck run"
    # a failing check raises in its cell, and a cell that raises fails the build (-W)
    assert cells.count("raise_exception=True") == calls, f"{page.name}: a gradcheck without raise_exception=True"
    section_link = re.search(r"\]\(\.\./notebooks/\d\d_\w+\.ipynb#[\w-]+\)", text)
    assert section_link, f"{page.name}: no link to a notebook section"
    for heading in ("## Forward", "## Backward (VJP)", "## Forward mode (JVP)"):
        assert heading in text, f"{page.name}: no section {heading!r}"
    assert text.count("$$") >= 4, f"{page.name}: no displayed math"
    # MathJax's text mode prints a backslash before "_" as it is: write \texttt{a_b}, not \texttt{a\_b}
    assert not re.search(r"\\text(?:tt)?\{[^}]*\\_", text), f"{page.name}: an escaped _ inside \\text or \\texttt"
    # "[" opening a line of an aligned block is read as an optional argument and vanishes: write "{}["
    bracket = re.search(r"(\\begin\{aligned\}|\\\\)[ \t]*\n[ \t]*\[", text)
    assert not bracket, f"{page.name}: an aligned line opens with ["
    includes = _includes(page)
    assert len(includes) >= 3, f"{page.name}: the forward, backward and JVP code should be included"
    for src, obj in includes:
        assert src.is_file(), f"{page.name}: {src} does not exist"
        assert obj in _defined(src), f"{page.name}: {obj} is not defined in {src.name}"


def test_the_index_lists_every_page():
    index = (ROOT / "docs" / "derivations" / "index.md").read_text()
    listed = set(re.findall(r"^(\w+)$", index, re.M))
    assert {p.stem for p in PAGES} <= listed, sorted({p.stem for p in PAGES} - listed)
