"""Display math stands apart in the notebooks' and the site's markdown, where MyST parses it.

MyST reads ``$$ ... $$`` as display math only as a block of its own: on a line inside a paragraph
(no blank line before or after it) or in the middle of a line it stays text, and the site shows the
``$`` signs and the TeX (``\\frac``, ``\\varepsilon``).  Jupyter renders both, so the notebooks look
right there and wrong on the site.  The built site is checked too (``tests/test_docs_site.py``);
this check needs no build.
"""

import json
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^\s*(```|~~~)")


FILES = sorted((ROOT / "notebooks").glob("*.ipynb")) + sorted(
    p for p in (ROOT / "docs").rglob("*.md") if not {"_build", "notebooks"} & set(p.relative_to(ROOT / "docs").parts)
)


def _markdown(path):
    """``[(where, markdown text)]``: a notebook's markdown cells, or a page."""
    if path.suffix == ".ipynb":
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
        return [(f"cell {i}", "".join(c["source"])) for i, c in enumerate(cells) if c["cell_type"] == "markdown"]
    return [("", path.read_text(encoding="utf-8"))]


def _misplaced(text):
    """The lines of ``text`` (outside code fences) where a ``$$`` block is not a block of its own."""
    lines, bad, fenced, inside = text.split("\n"), [], False, False
    for i, line in enumerate(lines):
        if FENCE.match(line):
            fenced = not fenced
        if fenced or "$$" not in line:
            continue
        s = line.strip()
        opens = not inside and s.startswith("$$")
        closes = s.endswith("$$") and (inside or (opens and len(s) > 2 and s.count("$$") >= 2))
        if not (opens or (inside and s.endswith("$$"))) or s.count("$$") > 2:
            bad.append(f"line {i + 1}: $$ in the middle of a line: {s[:80]}")
            continue
        if opens and i > 0 and lines[i - 1].strip():
            bad.append(f"line {i + 1}: no blank line before the $$ block: {s[:80]}")
        if closes and i + 1 < len(lines) and lines[i + 1].strip():
            bad.append(f"line {i + 1}: no blank line after the $$ block: {s[:80]}")
        inside = (opens or inside) and not closes
    return bad


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_display_math_is_a_block_of_its_own(path):
    bad = [f"{where} {line}".strip() for where, text in _markdown(path) for line in _misplaced(text)]
    assert not bad, f"{path.relative_to(ROOT)}:\n" + "\n".join(bad)
