"""Docstring parts written once (``npattn._docs.shared_doc``): every marker is filled, in place,
indented as its line; a part the docstring does not name is an error."""

import importlib
import inspect
import pkgutil
import re

import numpy as np
import pytest

import npattn
from npattn._docs import shared_doc

MARKER = re.compile(r"^[ \t]*<[A-Za-z_][A-Za-z0-9_]*>[ \t]*$", re.M)


def _public_objects():
    for info in pkgutil.walk_packages(npattn.__path__, "npattn."):
        if ".tools" in info.name or info.name.endswith("__main__"):
            continue
        try:
            module = importlib.import_module(info.name)
        except ImportError:  # an optional dependency (hypothesis, matplotlib)
            continue
        for name in getattr(module, "__all__", []):
            obj = getattr(module, name)
            yield f"{info.name}.{name}", obj
            if inspect.isclass(obj):
                for member, value in vars(obj).items():
                    yield f"{info.name}.{name}.{member}", value


def test_no_marker_is_left_in_a_public_docstring():
    left = [where for where, obj in _public_objects() if MARKER.search(getattr(obj, "__doc__", None) or "")]
    assert not left, left


def test_the_part_takes_the_markers_indent_and_keeps_blank_lines_blank():
    @shared_doc(part="a\n\n    b\n")
    def f():
        """Head.

        Notes
        -----
        <part>
        tail
        """

    assert f.__doc__ == "Head.\n\n        Notes\n        -----\n        a\n\n            b\n        tail\n        "


def test_a_part_without_its_marker_is_an_error():
    def f():
        """No markers here."""

    with pytest.raises(ValueError, match=r"f'? has no line <raises>"):
        shared_doc(raises="TypeError")(f)


@pytest.mark.parametrize("op", ["relu", "gelu", "silu", "softmax", "dropout"])
def test_the_activations_backward_sections_are_written_once_and_name_the_op(op):
    import textwrap

    from npattn._docs import backward_sections
    from npattn.functional import activation

    backward = getattr(activation, f"{op}_backward")
    cache = type(getattr(activation, op)(np.ones(3), *((0.0,) if op == "dropout" else ()))[1]).__name__
    sections = textwrap.indent(textwrap.dedent(backward_sections(op, cache, "")).strip("\n"), "    ")
    # the op's own text around "The upstream gradient" (relu's names dL/dy) aside, the sections read whole
    doc = re.sub(r"The upstream gradient.*\n", "The upstream gradient\n", backward.__doc__)
    assert sections in doc
    assert f"cache : {cache}\n        The cache ``{op}`` returned." in backward.__doc__
    assert "Returns\n    -------\n    ndarray\n        ``dx``, of ``x``'s shape and dtype." in backward.__doc__


@pytest.mark.parametrize("cls", ["Linear", "LayerNorm", "RMSNorm", "Dropout", "FeedForward", "Embedding"])
def test_the_layers_backward_and_forward_sections_are_written_once(cls):
    import textwrap

    from npattn.nn import layers

    def block(text):
        return textwrap.indent(textwrap.dedent(text).strip("\n"), "        ")

    returns = ("None", "Token ids have no gradient.") if cls == "Embedding" else ()
    assert block(layers._backward_sections(*returns)) in getattr(layers, cls).backward.__doc__
    if cls in ("LayerNorm", "RMSNorm"):
        assert block(layers._NORM_FORWARD_SECTIONS) in getattr(layers, cls).forward.__doc__
        assert "``(..., *normalized_shape)``; cast to the module's dtype." in getattr(layers, cls).forward.__doc__


@pytest.mark.parametrize("cls", ["LayerNorm", "RMSNorm"])
def test_the_norms_share_one_input_check_naming_their_class_and_shape(cls):
    import npattn

    norm = getattr(npattn, cls)((2, 3))
    with pytest.raises(ValueError, match=re.escape(f"x: expected shape (..., 2, 3) for {cls}((2, 3)), got (4, 3)")):
        norm(np.ones((4, 3)))
    assert norm(np.ones((4, 2, 3))).dtype == np.float64


@pytest.mark.parametrize(
    "op, cache",
    [("scaled_dot_product_attention", "AttentionCache"), ("memory_efficient_attention", "MemoryEfficientCache")],
)
def test_the_attention_cores_share_their_sections_naming_their_own_op(op, cache):
    import textwrap

    from npattn import _docs
    from npattn import functional as F

    def block(text):
        return textwrap.indent(textwrap.dedent(text).strip("\n"), "    ")

    forward = getattr(F, op).__doc__
    for part in _docs.ATTENTION_FORWARD.values():
        assert block(part) in forward
    assert block(_docs.attention_backward_sections(op)) in getattr(F, f"{op}_backward").__doc__
    assert block(_docs.attention_jvp_sections(op, cache)) in getattr(F, f"{op}_jvp").__doc__
    backward_jvp = getattr(F, f"{op}_backward_jvp").__doc__
    assert block(_docs.attention_backward_jvp_sections(op, cache)) in backward_jvp
    assert f"cache : {cache}\n        The cache ``{op}`` returned." in backward_jvp
    assert f"as ``{op}_jvp`` takes them" in backward_jvp


@pytest.mark.parametrize(
    "op, args", [("relu", ""), ("gelu", ""), ("silu", ""), ("softmax", ""), ("dropout", ", 0.5, rng=1")]
)
def test_the_activations_jvp_examples_are_written_once_and_call_their_own_op(op, args):
    import textwrap

    from npattn.functional import activation

    doc = getattr(activation, f"{op}_jvp").__doc__
    assert textwrap.indent(textwrap.dedent(activation._jvp_example(op, args)).strip("\n"), "    ") in doc
    assert f">>> tout = F.{op}_jvp(cache, tx)\n    >>> f = lambda s: F.{op}(x + s * tx{args})[0]\n    >>> fd = " in doc


def test_the_blocks_share_their_forward_returns_and_the_backward_raises():
    import textwrap

    from npattn._docs import BACKWARD_RAISES
    from npattn.nn import transformer

    def block(text, indent):
        return textwrap.indent(textwrap.dedent(text).strip("\n"), indent)

    for cls in (transformer.EncoderBlock, transformer.DecoderBlock):
        assert block(transformer._FORWARD_RETURNS, "        ") in cls.forward.__doc__
    assert "Raises\n        ------\n" + block(BACKWARD_RAISES, "        ") in transformer.EncoderBlock.backward.__doc__


def test_the_moe_modules_share_their_raises_sections():
    import textwrap

    from npattn.nn import moe

    def entries(text, indent):
        return "Raises\n" + indent + "------\n" + textwrap.indent(textwrap.dedent(text).strip("\n"), indent)

    for cls in (moe.TopKRouter, moe.Experts, moe.GptOssExperts, moe.GatedMLP, moe.SparseMoeBlock):
        assert entries(moe._INIT_RAISES, "    ") in cls.__doc__
    for cls in (moe.TopKRouter, moe.GatedMLP, moe.SparseMoeBlock):
        assert entries(moe._FORWARD_RAISES, "        ") in cls.forward.__doc__
    for cls in (moe.Experts, moe.GatedMLP, moe.SparseMoeBlock):
        assert entries(moe._BACKWARD_RAISES, "        ") in cls.backward.__doc__


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm", "linear", "embedding", "cross_entropy"])
def test_the_ops_backward_arguments_and_raises_are_written_once_and_name_the_op(op):
    import textwrap

    from npattn import functional as F
    from npattn._docs import OP_BACKWARD_RAISES, op_backward_args

    def block(text):
        return textwrap.indent(textwrap.dedent(text).strip("\n"), "    ")

    doc = getattr(F, f"{op}_backward").__doc__
    assert block(op_backward_args(op)) in doc and block(OP_BACKWARD_RAISES) in doc
    assert f"The cache ``{op}`` returned (only that op's cache is accepted)." in doc


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_the_norms_jvp_examples_are_written_once_and_call_their_own_op(op):
    import textwrap

    from npattn.functional import norm

    doc = getattr(norm, f"{op}_jvp").__doc__
    assert textwrap.indent(textwrap.dedent(norm._jvp_example(op)).strip("\n"), "    ") in doc
    assert f">>> tout = F.{op}_jvp(cache, tx, tw)\n" in doc


@pytest.mark.parametrize("op, cache", [("layer_norm", "LayerNormCache"), ("rms_norm", "RMSNormCache")])
def test_the_norms_forward_sections_are_written_once_and_name_the_op(op, cache):
    import textwrap

    from npattn.functional import norm

    doc = getattr(norm, op).__doc__
    assert textwrap.indent(textwrap.dedent(norm._forward_tail(op, cache)).strip("\n"), "    ") in doc
    assert f"cache : {cache}\n        For ``{op}_backward`` and ``{op}_jvp``." in doc


def test_the_standard_examples_part_is_filled_where_named_and_optional_elsewhere():
    from npattn._docs import EXAMPLES

    @shared_doc()
    def f():
        """Do it.

        <examples>
        >>> 1
        1
        """

    @shared_doc()
    def g():
        """Nothing to fill."""

    assert f.__doc__.splitlines()[2:6] == [
        "        Examples",
        "        --------",
        "        >>> import numpy as np",
        "        >>> from npattn import functional as F",
    ]
    assert EXAMPLES.split() == " ".join(f.__doc__.splitlines()[2:6]).split()
    assert g.__doc__ == "Nothing to fill."
    with pytest.raises(ValueError, match="<other>"):
        shared_doc(other="x")(g)
