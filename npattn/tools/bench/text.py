"""Aligned text columns for every section's table."""

from __future__ import annotations

__all__ = ["fmt", "table", "shape_str"]


def fmt(x, spec):
    """``format(x, spec)``, or ``"-"`` for None (a missing measurement)."""
    return "-" if x is None else format(x, spec)


def table(columns, rows):
    """Lines of a table aligned on the widest cell of each column.  ``columns``: ``(title, align)``
    pairs, ``align`` ``"<"`` (text) or ``">"`` (numbers); ``rows``: lists of strings."""
    widths = [max([len(title)] + [len(r[i]) for r in rows]) for i, (title, _) in enumerate(columns)]

    def line(cells):
        return "  ".join(f"{c:{a}{w}}" for c, (_, a), w in zip(cells, columns, widths)).rstrip()

    return [line([title for title, _ in columns])] + [line(r) for r in rows]


def shape_str(shape):
    """``b=2 h=4 L=64 ...`` from a row's ``shape``."""
    names = {"batch": "b", "heads": "h", "seq": "L", "head_dim": "E", "d_model": "d", "d_ff": "ff", "layers": "n"}
    return " ".join(f"{short}={shape[k]}" for k, short in names.items() if k in shape)
