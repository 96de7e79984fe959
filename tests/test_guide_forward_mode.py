"""The guide "Forward mode: the JVP of attention" (docs/guides/forward_mode.md) runs as written:
every python block, in order, in one namespace (its asserts are the checks)."""

import pathlib
import re

GUIDE = pathlib.Path(__file__).resolve().parents[1] / "docs" / "guides" / "forward_mode.md"


def test_the_guide_runs(capsys):
    blocks = re.findall(r"```python\n(.*?)```", GUIDE.read_text(), flags=re.S)
    assert len(blocks) >= 5
    namespace: dict = {"__name__": "forward_mode_guide"}
    for i, code in enumerate(blocks):
        exec(compile(code, f"{GUIDE.name}[block {i}]", "exec"), namespace)
    out = capsys.readouterr().out
    assert "(2, 4, 16, 8)" in out and "(2, 10, 16) (2, 10, 16)" in out
