"""Packaging contract: importing npattn pulls in numpy and the standard library only; every
public module has ``__all__``; ``py.typed`` ships; install hints name both forms of an extra."""

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import npattn

ROOT = Path(__file__).resolve().parents[1]

OPTIONAL = ("matplotlib", "hypothesis", "tqdm", "torch", "scipy", "threadpoolctl", "nbclient")


def test_import_is_numpy_only():
    code = (
        "import sys\n"
        "before = set(sys.modules)\n"
        "import npattn, npattn.functional, npattn.book, npattn.models, npattn.optim, npattn.masks\n"
        "new = {m.split('.')[0] for m in set(sys.modules) - before}\n"
        f"bad = sorted(new & set({OPTIONAL!r}))\n"
        "assert not bad, bad\n"
        "third = {m for m in new if m not in sys.stdlib_module_names}\n"
        "assert third <= {'numpy', 'npattn'}, sorted(third)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_version_and_cli_version():
    assert npattn.__version__.count(".") == 2
    out = subprocess.run([sys.executable, "-m", "npattn", "--version"], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == f"npattn {npattn.__version__}"


def test_public_names():
    for name in (
        "Module",
        "Parameter",
        "Linear",
        "LayerNorm",
        "Dropout",
        "Embedding",
        "FeedForward",
        "MultiHeadAttention",
        "EncoderBlock",
        "gradcheck",
        "no_grad",
        "TinyTransformer",
    ):
        assert hasattr(npattn, name), name


def _public_modules():
    """Every module of the package whose dotted name has no part starting with ``_``."""
    import pkgutil

    names = ["npattn"] + [i.name for i in pkgutil.walk_packages(npattn.__path__, "npattn.")]
    return sorted(n for n in names if not any(part.startswith("_") for part in n.split(".")))


OPTIONAL_MODULES = {"npattn.testing": "hypothesis", "npattn.testing.strategies": "hypothesis"}


@pytest.mark.parametrize("modname", _public_modules())
def test_every_public_module_has_all(modname):
    """``__all__`` exists, names each public name once, and every name in it resolves (so ``from
    m import *`` and the API pages show the module's own names, not ``np``, ``st`` or ``Optional``)."""
    if modname in OPTIONAL_MODULES:
        pytest.importorskip(OPTIONAL_MODULES[modname])
    module = importlib.import_module(modname)
    assert hasattr(module, "__all__"), f"{modname} has no __all__"
    names = list(module.__all__)
    assert all(isinstance(n, str) for n in names), modname
    assert len(set(names)) == len(names), f"{modname}: __all__ repeats a name"
    missing = [n for n in names if not hasattr(module, n)]
    assert not missing, f"{modname}: __all__ names {missing}, which do not resolve"
    imported = {"np", "st", "Optional", "Any", "math", "numbers"} & set(names)
    assert not imported, f"{modname}: __all__ exports imported helpers {sorted(imported)}"


def test_public_modules_include_the_ones_that_lacked_all():
    mods = _public_modules()
    for name in ("npattn.generation", "npattn.optim", "npattn.testing.strategies", "npattn.functional.attention"):
        assert name in mods


def test_py_typed_is_shipped():
    """PEP 561: the package carries ``py.typed`` and setup.cfg puts it into the wheel."""
    import configparser
    from importlib import resources

    assert resources.files("npattn").joinpath("py.typed").is_file()
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    patterns = cfg["options.package_data"].get("npattn", "").split()
    assert "py.typed" in patterns, f"setup.cfg [options.package_data] npattn = {patterns}"


def _extras():
    import configparser

    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    return sorted(cfg["options.extras_require"])


def test_readme_lists_every_extra():
    readme = (ROOT / "README.md").read_text()
    extras = _extras()
    assert {"hf", "docs", "test"} <= set(extras)
    missing = [e for e in extras if f"`{e}`" not in readme]
    assert not missing, f"README.md does not list the extras {missing}"
    assert 'pip install ".[hf]"' in readme and 'pip install "npattn[hf]"' in readme


def _both_forms(text, extra):
    return f'pip install "npattn[{extra}]"' in text and f'pip install ".[{extra}]"' in text


def test_every_string_naming_an_extra_says_both_install_forms():
    """Every string of the package (messages and docstrings) that names an extra as
    ``npattn[extra]`` also gives the form that works from a clone, ``.[extra]``."""
    import ast
    import re

    found = 0
    for path in sorted((ROOT / "npattn").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                for extra in re.findall(r"npattn\[(\w+)\]", node.value):
                    found += 1
                    assert _both_forms(node.value, extra), f"{path.name}: {node.value[:200]!r}"
    assert found >= 3  # the docstrings of viz, demo, generate and strategies


def test_install_hint_says_both_forms():
    from npattn._hints import install_hint

    for extra in _extras():
        assert _both_forms(install_hint(extra), extra)


def test_missing_optional_packages_say_both_install_forms(monkeypatch, capsys):
    """The messages printed or raised when an optional package is missing."""
    import sys

    from npattn import viz
    from npattn.tools._train import Progress

    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    with pytest.raises(ImportError) as e:
        viz._pyplot()
    assert _both_forms(str(e.value), "viz")

    monkeypatch.setitem(sys.modules, "tqdm", None)
    Progress(10)
    assert _both_forms(capsys.readouterr().out, "demo")

    monkeypatch.setitem(sys.modules, "hypothesis", None)
    monkeypatch.delitem(sys.modules, "npattn.testing.strategies", raising=False)
    monkeypatch.delitem(sys.modules, "npattn.testing", raising=False)
    with pytest.raises(ImportError) as e:
        importlib.import_module("npattn.testing.strategies")
    assert _both_forms(str(e.value), "test")


def test_the_strategy_names_are_listed_once_and_all_resolve():
    import npattn.testing as testing
    from npattn.testing import _names

    strategies = pytest.importorskip("npattn.testing.strategies")
    assert strategies.__all__ == list(_names.STRATEGIES)
    assert [n for n in testing.__all__ if n in _names.STRATEGIES] == list(_names.STRATEGIES)
    for name in _names.STRATEGIES:
        assert getattr(testing, name) is getattr(strategies, name)
    assert not [
        n
        for n in dir(strategies)
        if n[0] != "_"
        and callable(getattr(strategies, n))
        and n not in strategies.__all__
        and getattr(getattr(strategies, n), "__module__", "") == strategies.__name__
    ]
