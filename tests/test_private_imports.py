"""Helpers shared across files are reached by public names (issue 29, item 4): the MoE module, the
functional RoPE and the layers import no private name of another npattn file; what they share
(``nn.layers``' check_features / input_tangent / the gated unit, ``functional.moe.sigmoid``,
``functional.rope_scaling``'s checks and frequencies) stays outside ``__all__``."""

import ast
import inspect

import pytest

import npattn.functional.moe as fmoe
import npattn.functional.rope as frope
import npattn.functional.rope_scaling as rope_scaling
import npattn.nn.layers as layers
import npattn.nn.moe as nmoe


def _private_imports(module):
    tree = ast.parse(inspect.getsource(module))
    return [
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.level >= 1
        for alias in node.names
        if alias.name.startswith("_") and not alias.name.startswith("__")
    ]


@pytest.mark.parametrize("module", [nmoe, frope, layers], ids=lambda m: m.__name__)
def test_no_private_name_imported_from_another_file(module):
    assert _private_imports(module) == []


@pytest.mark.parametrize(
    "module, names",
    [
        (layers, ("check_features", "input_tangent", "gated_unit", "gated_unit_backward", "gated_unit_jvp")),
        (fmoe, ("sigmoid",)),
        (rope_scaling, ("check_scaling", "resolve_base", "resolve_rotary_dim", "inverse_frequencies")),
    ],
    ids=lambda x: getattr(x, "__name__", "names"),
)
def test_shared_helpers_are_public_within_the_package_not_in_all(module, names):
    for name in names:
        assert callable(getattr(module, name)), name
        assert name not in module.__all__, name
