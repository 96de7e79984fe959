"""The guide "write your own module" (docs/guides/own_module.md) runs as written: every python
block, in order, in one namespace (its asserts are the checks)."""

import pathlib
import re

import pytest

GUIDE = pathlib.Path(__file__).resolve().parents[1] / "docs" / "guides" / "own_module.md"


def test_the_guide_runs(capsys):
    pytest.importorskip("hypothesis")
    blocks = re.findall(r"```python\n(.*?)```", GUIDE.read_text(), flags=re.S)
    assert len(blocks) >= 7
    namespace: dict = {"__name__": "own_module_guide"}
    for i, code in enumerate(blocks):
        exec(compile(code, f"{GUIDE.name}[block {i}]", "exec"), namespace)
    out = capsys.readouterr().out
    assert "proj_a.weight" in out and "step 2: loss" in out
    assert "gradcheck GatedUnit: ok" in out
    assert "backward_jvp matches central differences" in out and "gradgradcheck GatedUnit: ok" in out
    assert "['proj_b.weight'" in out or "'proj_b.weight'" in out  # the broken beta is found there
