"""Caches and saved states read by name (issue 29, item 3): no positional unpacking of 8 or more
names in the delta rule's, the convolution's and the MoE pairs (both tiers), GatedDeltaNet and the
strategies; the textbook causal_conv1d's cache has named fields (``final_state`` among them) and
still reads as the tuple it was."""

import ast
import inspect

import numpy as np

import npattn.functional as F
from npattn.functional import delta_rule, moe
from npattn.functional import reference as R
from npattn.nn import delta_net
from npattn.testing import strategies

# the reference tier's functions of the sections named: their caches are read by name
_REFERENCE_OPS = ("gated_delta_rule", "causal_conv1d", "topk_router", "moe_experts")


def _wide_unpacks(tree, widest=7):
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        for target in node.targets
        if isinstance(target, (ast.Tuple, ast.List)) and len(target.elts) > widest
    ]


def test_no_positional_unpacking_of_eight_names():
    for module in (delta_rule, moe, delta_net, strategies):
        assert not _wide_unpacks(ast.parse(inspect.getsource(module))), module.__name__
    tree = ast.parse(inspect.getsource(R))
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith(_REFERENCE_OPS):
            assert not _wide_unpacks(node), node.name


def test_reference_causal_conv1d_cache_has_named_fields():
    rng = np.random.default_rng(3)
    x, w, b = rng.standard_normal((2, 6, 5)), rng.standard_normal((5, 4)), rng.standard_normal(5)
    state = rng.standard_normal((2, 3, 5))
    _, cache = R.causal_conv1d(x, w, b, activation="silu", initial_state=state, output_final_state=True)
    _, fast = F.causal_conv1d(x, w, b, activation="silu", initial_state=state, output_final_state=True)
    np.testing.assert_array_equal(cache.final_state, np.concatenate([state, x], axis=1)[:, -3:])
    np.testing.assert_allclose(cache.final_state, fast.final_state, rtol=0, atol=0)
    assert cache[-1] is cache.final_state  # still the tuple's last item, as documented before
    assert cache.has_bias and cache.has_initial_state and cache.act is not None
    assert cache.weight is w and cache.windows.shape == (2, 6, 5, 4)
    _, plain = R.causal_conv1d(x, w)
    assert plain.final_state is None and plain.act is None and not plain.has_bias
