"""Helpers shared across files are reached by public names (issue 29, item 4): the MoE module, the
functional RoPE and the layers import no private name of another npattn file; what they share
(``nn.layers``' check_features / input_tangent / the gated unit, ``functional.moe.sigmoid``,
``functional.rope_scaling``'s checks and frequencies) stays outside ``__all__``.

The fast tier's unvalidated kernels are public names of their own files, ``<op>_kernel`` beside
``<op>`` (outside ``__all__``: not ops of the API), re-exported by ``functional.kernels`` under
the op's own name; the chunked delta rule's helpers that ``kda.py`` shares are public in
``delta_rule.py``."""

import ast
import importlib
import inspect

import pytest

import npattn.functional as F
import npattn.nn.delta_net as delta_net
import npattn.nn.layers as layers
import npattn.nn.moe as nmoe

# by import_module: the package's attributes embedding, linear, rope ... are the ops, not the files
activation = importlib.import_module("npattn.functional.activation")
attention = importlib.import_module("npattn.functional.attention")
conv = importlib.import_module("npattn.functional.conv")
delta_rule = importlib.import_module("npattn.functional.delta_rule")
embedding = importlib.import_module("npattn.functional.embedding")
kda = importlib.import_module("npattn.functional.kda")
kernels = importlib.import_module("npattn.functional.kernels")
linear = importlib.import_module("npattn.functional.linear")
loss = importlib.import_module("npattn.functional.loss")
memory_efficient = importlib.import_module("npattn.functional.memory_efficient")
fmoe = importlib.import_module("npattn.functional.moe")
norm = importlib.import_module("npattn.functional.norm")
frope = importlib.import_module("npattn.functional.rope")
rope_scaling = importlib.import_module("npattn.functional.rope_scaling")
sparse = importlib.import_module("npattn.functional.sparse_attention")
OP_FILES = [activation, attention, conv, delta_rule, embedding, linear, loss, memory_efficient, fmoe, norm, frope]
gradcheck = importlib.import_module("npattn.testing.gradcheck")
gradgradcheck = importlib.import_module("npattn.testing.gradgradcheck")
check = importlib.import_module("npattn.tools.check")


def _private_imports(module):
    tree = ast.parse(inspect.getsource(module))
    return [
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.level >= 1
        for alias in node.names
        if alias.name.startswith("_") and not alias.name.startswith("__")
    ]


@pytest.mark.parametrize(
    "module", [nmoe, layers, delta_net, kda, sparse, kernels, gradgradcheck, check, *OP_FILES], ids=lambda m: m.__name__
)
def test_no_private_name_imported_from_another_file(module):
    assert inspect.ismodule(module)
    assert _private_imports(module) == []


@pytest.mark.parametrize(
    "module, names",
    [
        (layers, ("check_features", "input_tangent", "gated_unit", "gated_unit_backward", "gated_unit_jvp")),
        (fmoe, ("sigmoid",)),
        (gradcheck, ("companion",)),
        (rope_scaling, ("check_scaling", "resolve_base", "resolve_rotary_dim", "inverse_frequencies")),
        (
            delta_rule,
            (
                "checked_inputs",
                "chunk_blocks",
                "pad_chunks",
                "segment_sums",
                "segment_sums_backward",
                "triangular_matmul",
                "flushed_exp",
                "unit_lower_inverse",
            ),
        ),
    ],
    ids=lambda x: getattr(x, "__name__", "names"),
)
def test_shared_helpers_are_public_within_the_package_not_in_all(module, names):
    for name in names:
        assert callable(getattr(module, name)), name
        assert name not in module.__all__, name


@pytest.mark.parametrize("module", OP_FILES, ids=lambda m: m.__name__)
def test_each_op_has_its_public_kernel_outside_all(module):
    ops = [n for n in module.__all__ if callable(getattr(module, n)) and not isinstance(getattr(module, n), type)]
    assert ops
    for op in ops:
        kernel = getattr(module, op + "_kernel")
        assert callable(kernel) and op + "_kernel" not in module.__all__, op
        assert getattr(kernels, op) is kernel, op
        assert op + "_kernel" not in F.__all__, op


def test_gradgradcheck_is_gradchecks_second_order_at_every_path():
    """One engine for first and second order: the old module path re-exports the same function."""
    import npattn
    import npattn.testing

    assert gradgradcheck.gradgradcheck is gradcheck.gradgradcheck is npattn.gradgradcheck
    assert npattn.testing.gradgradcheck is npattn.gradgradcheck
    assert "gradgradcheck" in gradcheck.__all__
