"""Docstring parts that sibling functions and classes share, written once.

A docstring names a shared part by a line holding only ``<name>``; :func:`shared_doc` puts the
part there, indented as that line.  The finished ``__doc__`` is what ``help()``, doctest and the
API pages read, so every docstring still reads whole.
"""

from __future__ import annotations

import re
import textwrap
from typing import Callable, TypeVar

T = TypeVar("T")

__all__ = ["shared_doc", "BACKWARD_RAISES"]

#: The entries of a module's ``backward`` under its docstring's ``Raises`` header.
BACKWARD_RAISES = """
    RuntimeError
        No forward to differentiate.
    ValueError
        ``dy`` of the wrong shape.
    """


def shared_doc(**parts: str) -> Callable[[T], T]:
    """Decorator: each line ``<name>`` of the docstring becomes ``parts[name]`` (its lines indented
    as the marker; blank lines stay blank).  A part its docstring does not name is an error.  The
    standard parts (``<examples>``, :data:`EXAMPLES`; ``<reference_examples>``,
    :data:`REFERENCE_EXAMPLES`) are filled where the docstring names them.

    Examples
    --------
    >>> from npattn._docs import shared_doc
    >>> @shared_doc(returns="out : ndarray\\n    The result.")
    ... def f():
    ...     '''Do it.
    ...
    ...     Returns
    ...     -------
    ...     <returns>
    ...     '''
    >>> print(f.__doc__.splitlines()[4])
        out : ndarray
    """

    def fill(obj: T) -> T:
        if obj.__doc__ is not None:  # None under python -OO
            owner = getattr(obj, "__qualname__", obj)
            doc = _fill(obj.__doc__, parts, owner)
            named = {k: v for k, v in STANDARD_PARTS.items() if re.search(rf"^[ \t]*<{k}>$", doc, flags=re.M)}
            obj.__doc__ = _fill(doc, named, owner)
        return obj

    return fill


def _fill(doc: str, parts: dict[str, str], owner: object) -> str:
    """``doc`` with each line ``<name>`` replaced by ``parts[name]``, indented as that line."""
    for name, text in parts.items():
        block = textwrap.dedent(text).strip("\n") + "\n"
        doc, n = re.subn(
            rf"^([ \t]*)<{re.escape(name)}>\n", lambda m: textwrap.indent(block, m.group(1)), doc, flags=re.M
        )
        if n == 0:
            raise ValueError(f"shared_doc: {owner!r} has no line <{name}>")
    return doc


# -- the functional pairs' sections ----------------------------------------------------------------
# Every fast op's ``op_jvp`` and ``op_backward_jvp`` documents the same arguments, results and errors,
# with the op's own names: the sections below, filled per op (``<jvp_sections>``,
# ``<backward_jvp_sections>``; an activation's ``op_backward``: ``<backward_sections>``), and the last
# lines of each ``op_jvp`` example (``<fd_check>``).

#: The head of a functional op's examples: the section's header and the two imports they start from.
EXAMPLES = """
    Examples
    --------
    >>> import numpy as np
    >>> from npattn import functional as F
    """


def tiers_examples(sentence: str) -> str:
    """The head of examples that set the two tiers side by side: the section's header,
    ``sentence``, the imports of both tiers (``F``, ``R``) and ``rng``."""
    return f"""
    Examples
    --------
    {sentence}

    >>> import numpy as np
    >>> from npattn import functional as F
    >>> from npattn.functional import reference as R
    >>> rng = np.random.default_rng(0)
    """


#: The head of a textbook op's examples (``npattn.functional.reference``), set beside the fast tier.
REFERENCE_EXAMPLES = tiers_examples("The textbook formula gives the fast tier's numbers:")

#: The parts :func:`shared_doc` fills wherever a docstring names them, without being passed.
STANDARD_PARTS = {"examples": EXAMPLES, "reference_examples": REFERENCE_EXAMPLES}

#: The end of every ``op_jvp`` example: ``tout`` against the central difference of ``f`` along the tangent.
FD_CHECK = """
    >>> fd = (f(1e-6) - f(-1e-6)) / 2e-6                # the central difference along the tangent
    >>> bool(np.allclose(tout, fd, rtol=1e-5, atol=1e-7))
    True
    """


def _wrapped(text: str) -> str:
    """``text`` wrapped as the pairs' docstrings are: an entry's description (8 columns in) ends by column 100."""
    return textwrap.fill(text, 92, break_long_words=False, break_on_hyphens=False)


def jvp_sections(
    op: str,
    cache: str,
    tangents: str = "``tx``, of ``x``'s shape (None: zero).",
    returns: str = "``ty``, of ``y``'s shape and dtype.",
    most: str = "one tangent",
    wrong: str = "",
) -> str:
    """The Parameters, Returns and Raises of ``op_jvp(cache, *tangents)`` (defaults: one input ``x``;
    ``most``: how many tangents it takes, ``wrong``: what else is a ValueError)."""
    text = f"""
        Parameters
        ----------
        cache : {cache}
            The cache ``{op}`` returned.
        *tangents : ndarray or None
            <tangents>

        Returns
        -------
        ndarray
            <returns>

        Raises
        ------
        TypeError
            <type_error>
        ValueError
            A tangent of the wrong shape{wrong}.
        """
    type_error = f"A cache from another op, more than {most}, or a tangent that is not a real array."
    parts = {"tangents": tangents, "returns": returns, "type_error": type_error}
    return _fill(textwrap.dedent(text), {k: _wrapped(v) for k, v in parts.items()}, f"{op}_jvp")


#: A fast op's ``op_backward(dout, cache)`` errors: its docstring's ``Raises`` section.
OP_BACKWARD_RAISES = """
    Raises
    ------
    TypeError
        A cache from another op, or ``dout`` not a real array.
    ValueError
        ``dout`` of the wrong shape.
    """


def op_backward_args(op: str) -> str:
    """The ``Parameters`` section of ``op_backward(dout, cache)`` for an op whose cache is a tuple."""
    return f"""
    Parameters
    ----------
    dout : array_like
        The upstream gradient, of the output's shape.
    cache : tuple
        The cache ``{op}`` returned (only that op's cache is accepted).
    """


def backward_sections(op: str, cache: str, dout: str = ", of ``y``'s shape.") -> str:
    """The Parameters, Returns and Raises of ``op_backward(dout, cache)`` for an op of one input
    ``x`` (``dout``: what follows "The upstream gradient")."""
    returns = """
    Returns
    -------
    ndarray
        ``dx``, of ``x``'s shape and dtype.
    """
    return _dout_and_cache(op, cache, dout) + textwrap.dedent(returns) + textwrap.dedent(OP_BACKWARD_RAISES)


def _dout_and_cache(op: str, cache: str, dout: str) -> str:
    """The head of a pair's backward ``Parameters``: ``dout`` (``dout``: what follows "The upstream
    gradient") and the ``cache`` of type ``cache`` that ``op`` returned."""
    return textwrap.dedent(
        f"""
        Parameters
        ----------
        dout : array_like
            The upstream gradient{dout}
        cache : {cache}
            The cache ``{op}`` returned.
        """
    )


#: ``backward_jvp_sections``' errors for an op with several inputs that have tangents.
SEVERAL_TANGENTS = {
    "too_many": "too many tangents, ",
    "wrong": "``dout``, ``ddout`` or a tangent of the wrong shape, or a tangent for an input the forward did not have.",
}


def backward_jvp_sections(
    op: str,
    cache: str,
    dout: str = ", of ``y``'s shape.",
    tangents: str = "",
    grads: str = "``dx``",
    grad_tangents: str = "``tdx``, its tangent, of ``x``'s shape.",
    too_many: str = "more than one tangent, ",
    wrong: str = "``dout``, ``ddout`` or ``tx`` of the wrong shape.",
) -> str:
    """The Parameters, Returns and Raises of ``op_backward_jvp(dout, cache, tangents, ddout)``
    (defaults: one input ``x``; ``dout`` is what follows "The upstream gradient", ``too_many`` and
    ``wrong`` the op's TypeError and ValueError)."""
    kind = "tuple" if grads.startswith("``(") else "ndarray"
    text = f"""
        <dout_and_cache>
        tangents : tuple
            <tangents>
        ddout : array_like, optional
            The tangent of ``dout`` (None: zero).

        Returns
        -------
        grads : {kind}
            {grads}, exactly ``{op}_backward(dout, cache)``.
        grad_tangents : {kind}
            <grad_tangents>

        Raises
        ------
        TypeError
            <type_error>
        ValueError
            <wrong>
        """
    parts = {
        "tangents": tangents or f"``(tx,)`` as ``{op}_jvp`` takes it (``x``'s shape); None or ``()``: zero.",
        "grad_tangents": grad_tangents,
        "type_error": f"A cache from another op, ``tangents`` not a tuple, {too_many}or an array that is not real.",
        "wrong": wrong,
    }
    text = _fill(textwrap.dedent(text), {"dout_and_cache": _dout_and_cache(op, cache, dout)}, f"{op}_backward_jvp")
    return _fill(text, {k: _wrapped(v) for k, v in parts.items()}, f"{op}_backward_jvp")


# -- the attention cores' sections ---------------------------------------------------------------
# ``scaled_dot_product_attention`` and ``memory_efficient_attention`` take the same arguments and
# options and their pairs document the same gradients and tangents: the parts below, with each
# core's own op and cache names.

#: The attention cores' first arguments, ``q`` to ``scale`` (their ``Parameters``' head).
ATTENTION_ARGS = """
    q : array_like
        ``(..., Hq, Lq, E)`` (or ``(..., Lq, E)``), float32 or float64.
    k : array_like
        ``(..., Hk, Lk, E)``.
    v : array_like
        ``(..., Hk, Lk, Ev)``.
    attn_mask : array_like, optional
        Bool (True = may attend) or float (added to the scaled scores), broadcastable to
        ``(..., Hq, Lq, Lk)``.
    is_causal : bool
        Query ``i`` sees keys at positions ``<= i`` (aligned by ``causal_align``).
    dropout_p : float
        Dropout on the attention weights, in ``[0, 1]``.
    scale : float, optional
        Default ``1 / sqrt(E)``.
    """

#: The attention cores' other arguments, ``rng`` to ``mask_grad`` (their ``Parameters``' tail).
ATTENTION_OPTIONS = """
    rng : numpy.random.Generator, int or None
        For dropout.
    enable_gqa : bool
        Grouped-query attention: ``Hq`` a multiple of ``Hk``.
    causal_align : {"top_left", "bottom_right"}
    window : tuple of two int, optional
        ``(left, right)``, -1 = unbounded.
    alibi_slopes : array_like, optional
        Broadcastable to ``(..., Hq)``.
    softcap : float, optional
        > 0.
    sinks : array_like, optional
        ``(Hq,)``.
    mask_grad : bool
        With a float mask: the backward also returns ``dmask``.
    """

#: The attention cores' forward errors (the entries under ``Raises``).
ATTENTION_RAISES = """
    TypeError
        Non-numeric or mixed float dtypes of q, k, v, an integer mask, a non-bool flag.
    ValueError
        Shapes that do not match or broadcast, heads that do not divide, ``dropout_p`` outside
        ``[0, 1]``, a bad ``window``/``causal_align``/``softcap``/``sinks``, ``+inf`` or NaN in a
        float mask, ``mask_grad`` without a float mask.
    """


#: The attention cores' forward parts by name (``<attention_args>``, ``<attention_options>``,
#: ``<attention_raises>``).
ATTENTION_FORWARD = {
    "attention_args": ATTENTION_ARGS,
    "attention_options": ATTENTION_OPTIONS,
    "attention_raises": ATTENTION_RAISES,
}


def attention_backward_sections(op: str) -> str:
    """The Parameters, Returns and Raises of an attention core's ``op_backward(dout, cache)``."""
    returns = """
    Returns
    -------
    dq, dk, dv : ndarray
        Each of its input's shape.
    dmask : ndarray
        With ``mask_grad``: of the mask's shape.
    dsinks : ndarray
        With ``sinks``: ``(Hq,)``.
    """
    return "".join(textwrap.dedent(part) for part in (op_backward_args(op), returns, OP_BACKWARD_RAISES))


def attention_jvp_sections(op: str, cache: str) -> str:
    """The Parameters, Returns and Raises of an attention core's ``op_jvp(cache, *tangents)``."""
    return textwrap.dedent(
        f"""
        Parameters
        ----------
        cache : {cache}
            The cache ``{op}`` returned.
        *tangents : ndarray or None
            In the order the backward returns gradients: ``tq``, ``tk``, ``tv`` (each of its input's
            own shape), then ``tmask`` (the float mask's shape; only with ``mask_grad``), then
            ``tsinks`` (``(Hq,)``; only with ``sinks``).  None, or left out at the end, is zero.

        Returns
        -------
        ndarray
            ``tout``, of ``out``'s shape ``(..., Hq, Lq, Ev)`` and dtype.

        Raises
        ------
        TypeError
            A cache from another op, too many tangents, or a tangent that is not a real array.
        ValueError
            A tangent of the wrong shape.
        """
    )


def attention_backward_jvp_sections(op: str, cache: str) -> str:
    """The Parameters, Returns and Raises of an attention core's
    ``op_backward_jvp(dout, cache, tangents, ddout)``."""
    text = """
        Parameters
        ----------
        dout : array_like
            The upstream gradient, of the output's shape.
        cache : {cache}
            The cache ``{op}`` returned.
        tangents : tuple or None
            <tangents>
        ddout : array_like, optional
            The tangent of ``dout`` (None: zero).

        Returns
        -------
        grads : tuple of ndarray
            ``(dq, dk, dv[, dmask][, dsinks])``, the backward's.
        grad_tangents : tuple of ndarray
            Their tangents, the same order, shapes and dtype.

        Raises
        ------
        TypeError
            A cache from another op, ``tangents`` not a tuple, too many tangents, or an array that is
            not real.
        ValueError
            ``dout``, ``ddout`` or a tangent of the wrong shape.
        """.format(cache=cache, op=op)
    tangents = (
        f"``(tq, tk, tv[, tmask][, tsinks])`` as ``{op}_jvp`` takes them, each None or of its input's shape;"
        " None or ``()``: all zero."
    )
    # wrapped one column narrower than _wrapped: the width these entries were first written at
    wrapped = textwrap.fill(tangents, 91, break_long_words=False, break_on_hyphens=False)
    return _fill(textwrap.dedent(text), {"tangents": wrapped}, f"{op}_backward_jvp")
