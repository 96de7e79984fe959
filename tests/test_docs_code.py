"""The README, the site's landing page and the user guides run as written: every ```python block
of a page, in order, in one namespace (the blocks' asserts and printed comments are the checks),
and the README stays a landing page (under 10 KB, the install and test commands first)."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
GUIDES = ROOT / "docs" / "guides"
# own_module.md and forward_mode.md have tests of their own
PAGES = [
    ROOT / "README.md",
    ROOT / "docs" / "index.md",
    GUIDES / "getting_started.md",
    GUIDES / "gradients_by_hand.md",
    GUIDES / "numpy_project.md",
    GUIDES / "open_models.md",
    GUIDES / "conventions.md",
    GUIDES / "curvature.md",
]


def _blocks(path):
    return re.findall(r"```python\n(.*?)```", path.read_text(encoding="utf-8"), flags=re.S)


@pytest.mark.parametrize("path", PAGES, ids=[p.stem for p in PAGES])
def test_page_code_runs(path, capsys):
    blocks = _blocks(path)
    assert blocks, f"{path.name} has no python block"
    namespace: dict = {"__name__": f"docs_{path.stem}"}
    for i, code in enumerate(blocks):
        exec(compile(code, f"{path.name}[block {i}]", "exec"), namespace)
        out = capsys.readouterr().out
        # each print commented "# True" (a claim the page makes) printed True
        claims = [ln for ln in code.splitlines() if ln.lstrip().startswith("print(") and re.search(r"#\s*True$", ln)]
        assert out.count("True") >= len(claims), f"{path.name}[block {i}]: a claim did not hold:\n{out}"


def test_readme_is_a_landing_page():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.encode()) < 10_000, f"README.md is {len(text.encode())} bytes (at most 10 KB)"
    first = text[:600]
    assert 'pip install ".[test]"' in first and "python -m pytest" in first
    for link in re.findall(r"\]\(([^)#]+)\)", text):
        if not link.startswith("http"):
            assert (ROOT / link).exists(), f"README links to {link}, which does not exist"


def test_guide_pages_have_no_machine_numbers():
    """Performance numbers belong to the machine they were measured on, not to the docs."""
    text = (GUIDES / "performance.md").read_text(encoding="utf-8")
    assert not re.search(r"\d+(\.\d+)?\s*(GFLOP/s|ms\b|tokens/s|MiB)", text), "a measured number in performance.md"
