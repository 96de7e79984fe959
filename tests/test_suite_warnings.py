"""The suite stays quiet: npattn's own warning is an error in any test that does not expect it.

``setup.cfg``'s ``filterwarnings`` turns the module's "keeps 64 forward states" warning into an
exception, so a test that runs forwards whose backward never comes (an evaluation loop, a property
test reusing one module across its examples) fails until it runs them under ``npattn.no_grad()``
or releases them with ``clear_saved()``; a test about the warning expects it with ``pytest.warns``.
"""

import numpy as np
import pytest

import npattn
from npattn.nn.module import SAVED_STATES_WARNING


def _linear():
    return npattn.Linear(3, 2, rng=0), np.random.default_rng(1).standard_normal((4, 3))


def test_an_unexpected_saved_states_warning_fails_the_test():
    lin, x = _linear()
    for _ in range(SAVED_STATES_WARNING - 1):
        lin(x)
    with pytest.raises(RuntimeWarning, match=f"Linear keeps {SAVED_STATES_WARNING} forward states"):
        lin(x)


def test_an_expected_one_is_caught_with_pytest_warns():
    lin, x = _linear()
    with pytest.warns(RuntimeWarning, match="no_grad.*clear_saved") as caught:
        for _ in range(SAVED_STATES_WARNING + 2):
            lin(x)
    assert len(caught) == 1  # once, at the 64th state


def test_no_grad_and_clear_saved_keep_it_quiet():
    lin, x = _linear()
    with npattn.no_grad():
        for _ in range(2 * SAVED_STATES_WARNING):
            lin(x)
    assert lin.num_saved == 0
    for _ in range(2):
        for _ in range(SAVED_STATES_WARNING - 1):
            lin(x)
        lin.clear_saved()
        assert lin.num_saved == 0
