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
    as the marker; blank lines stay blank).  A part its docstring does not name is an error.

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
        doc = obj.__doc__
        if doc is None:  # python -OO
            return obj
        for name, text in parts.items():
            block = textwrap.dedent(text).strip("\n") + "\n"
            doc, n = re.subn(
                rf"^([ \t]*)<{re.escape(name)}>\n", lambda m: textwrap.indent(block, m.group(1)), doc, flags=re.M
            )
            if n == 0:
                raise ValueError(f"shared_doc: {getattr(obj, '__qualname__', obj)!r} has no line <{name}>")
        obj.__doc__ = doc
        return obj

    return fill
