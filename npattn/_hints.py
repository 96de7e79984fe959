"""The install hint of an optional extra, said once for every message that names one."""

from __future__ import annotations

__all__: list[str] = []


def install_hint(extra: str) -> str:
    """How to install the extra ``extra``: from the package index and from a clone.

    >>> from npattn._hints import install_hint
    >>> print(install_hint("hf"))
    pip install "npattn[hf]" (from a clone of the repository: pip install ".[hf]")
    """
    return f'pip install "npattn[{extra}]" (from a clone of the repository: pip install ".[{extra}]")'
