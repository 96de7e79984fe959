"""The Examples sections of the docstrings run as written (``doctest`` over every module of npattn).

Each module is one test, so a failure names it; numbers in examples are kept robust (seeds,
rounding, ``# doctest: +ELLIPSIS``).  Modules whose optional dependency is missing are skipped.
"""

import doctest
import importlib
import pkgutil

import numpy as np
import pytest

import npattn

OPTIONAL = {"npattn.viz": "matplotlib", "npattn.testing": "hypothesis", "npattn.testing.strategies": "hypothesis"}


def _modules():
    names = ["npattn"]
    for info in pkgutil.walk_packages(npattn.__path__, "npattn."):
        if ".tools" in info.name or info.name == "npattn.__main__":
            continue  # the command line: tested by running it
        names.append(info.name)
    return sorted(names)


MODULES = _modules()


@pytest.mark.parametrize("modname", MODULES)
def test_docstring_examples_run(modname):
    if modname in OPTIONAL:
        pytest.importorskip(OPTIONAL[modname])
    module = importlib.import_module(modname)
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    old = np.get_printoptions()
    np.set_printoptions(legacy="1.25")  # scalars print as 0.5, not np.float64(0.5)
    try:
        for test in finder.find(module, modname, globs={"np": np}):  # objects defined in this module only
            runner.run(test)
    finally:
        np.set_printoptions(**old)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{modname}: {result.failed} of {result.attempted} doctest examples failed (see output)"


def test_examples_exist():
    """The examples are there to run: the public pairs and modules carry them."""
    attempted = 0
    for modname in MODULES:
        if modname in OPTIONAL:
            continue
        module = importlib.import_module(modname)
        for test in doctest.DocTestFinder(exclude_empty=True).find(module, modname):
            attempted += len(test.examples)
    assert attempted >= 600, f"only {attempted} doctest examples in npattn"
