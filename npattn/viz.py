"""Plots for studying attention: weight heatmaps, per-head panels, masks, gradcheck reports, losses.

matplotlib is optional (``pip install "npattn[viz]"``, or ``pip install ".[viz]"`` from a
clone) and imported only when a function here is called, so ``import npattn`` and
``import npattn.viz`` stay numpy-only.  Every function works with the non-interactive ``Agg``
backend (nothing here calls ``plt.show``).

What each function returns:

========================  ==========================================================
``plot_attention``        the ``matplotlib.axes.Axes`` it drew on
``plot_heads``            a new ``matplotlib.figure.Figure`` with one Axes per head
``plot_mask``             the ``Axes`` it drew on
``plot_gradcheck``        the ``Axes`` it drew on
``plot_loss``             the ``Axes`` it drew on
========================  ==========================================================

Functions that return an ``Axes`` take ``ax=None``: with ``None`` they create a new figure
(``ax.figure``); pass your own ``Axes`` to draw into a larger layout.  Close figures you no
longer need (``plt.close(fig)``) when making many of them.

Arguments are checked before anything is drawn: a wrong type raises ``TypeError`` and a wrong
shape or value ``ValueError``, each naming the argument.
"""

from __future__ import annotations

import math
import numbers

import numpy as np

from ._docs import shared_doc
from ._hints import install_hint
from ._validate import to_numpy

__all__ = ["plot_attention", "plot_heads", "plot_mask", "plot_gradcheck", "plot_loss"]

# the first lines of every Examples section here
_AGG_SETUP = """
    >>> import numpy as np
    >>> import matplotlib
    >>> matplotlib.use("Agg")
    >>> from npattn import viz
    """

#: matrices up to this many rows and columns get their values written in the cells by default
ANNOTATE_MAX = 12


def _pyplot():
    """``matplotlib.pyplot``, or an ImportError telling how to install it."""
    try:
        import matplotlib.pyplot as plt
    except ImportError as e:  # pragma: no cover - exercised only without matplotlib
        raise ImportError(
            f"npattn.viz needs matplotlib, which is not installed; install it with {install_hint('viz')} "
            "(or pip install matplotlib)"
        ) from e
    return plt


# ---------------------------------------------------------------------------------------------
# argument checks


def _real_array(x, name):
    """A float64 ndarray from a real float or integer array-like (bool/complex/object: TypeError)."""
    if x is None:
        raise TypeError(f"{name}: expected an array, got None")
    try:
        a = to_numpy(x)
    except Exception as e:  # ragged lists and the like
        raise TypeError(f"{name}: expected a numeric array, got {type(x).__name__} ({e})") from None
    if a.dtype.kind not in "fiu":
        hint = " (for a boolean mask use plot_mask)" if a.dtype.kind == "b" else ""
        raise TypeError(f"{name}: expected a real float or integer array, got dtype {a.dtype}{hint}")
    return a.astype(np.float64)


def _squeeze_leading(a, keep, name, expected):
    """Drop leading axes of size 1 until ``a`` has ``keep`` dimensions; ValueError otherwise."""
    while a.ndim > keep and a.shape[0] == 1:
        a = a[0]
    if a.ndim != keep:
        raise ValueError(f"{name}: expected shape {expected}, got {a.shape}")
    return a


def _check_tokens(tokens, n, name, axis_desc):
    """``None`` or a sequence of ``n`` labels, returned as a list of ``str``."""
    if tokens is None:
        return None
    if isinstance(tokens, (str, bytes)):
        raise TypeError(
            f"{name}: expected a sequence of {n} labels, got a single string {tokens!r} (use e.g. text.split())"
        )
    try:
        labels = [str(t) for t in tokens]
    except TypeError:
        raise TypeError(f"{name}: expected a sequence of labels, got {type(tokens).__name__}") from None
    if len(labels) != n:
        raise ValueError(f"{name}: expected {n} labels ({axis_desc}), got {len(labels)}")
    return labels


def _check_ax(ax, name="ax"):
    _pyplot()  # the clear ImportError first
    if ax is None:
        return None
    from matplotlib.axes import Axes

    if not isinstance(ax, Axes):
        raise TypeError(f"{name}: expected a matplotlib Axes or None, got {type(ax).__name__}")
    return ax


def _check_bool_or_none(x, name):
    if x is not None and not isinstance(x, (bool, np.bool_)):
        raise TypeError(f"{name}: expected True, False or None, got {x!r}")
    return None if x is None else bool(x)


def _new_ax(ax, figsize):
    """``ax`` checked, or a new figure's Axes of ``figsize`` when it is None."""
    ax = _check_ax(ax)
    if ax is None:
        _, ax = _pyplot().subplots(figsize=figsize, layout="constrained")
    return ax


def _cell_figsize(lq, lk, base=0.5, lo=3.0, hi=9.0):
    w = min(hi, max(lo, lk * base + 1.8))
    h = min(hi, max(lo - 0.5, lq * base + 1.0))
    return w, h


def _slant(slanted):
    """Tick-label options: long or many labels slanted by 45 degrees, aligned at their ends."""
    return {"rotation": 45, "ha": "right"} if slanted else {"rotation": 0, "ha": "center"}


def _set_ticks(ax, labels_q, labels_k, lq, lk):
    if labels_k is not None:
        ax.set_xticks(range(lk))
        ax.set_xticklabels(labels_k, **_slant(max((len(t) for t in labels_k), default=0) > 2))
    if labels_q is not None:
        ax.set_yticks(range(lq))
        ax.set_yticklabels(labels_q)


def _annotate(ax, data, im, fmt="{:.2f}", fontsize=None):
    """Write each cell's value, dark text on light cells and light text on dark ones."""
    finite = data[np.isfinite(data)]
    if finite.size == 0:
        return
    norm = im.norm
    fontsize = fontsize or (9 if max(data.shape) <= 8 else 7)
    for (i, j), value in np.ndenumerate(data):
        if not np.isfinite(value):
            text, color = ("-inf" if value == -np.inf else str(value)), "black"
        else:
            shade = float(norm(value)) if norm.vmax != norm.vmin else 0.5
            rgba = im.cmap(shade)
            luminance = 0.299 * rgba[0] + 0.587 * rgba[1] + 0.114 * rgba[2]
            text, color = fmt.format(value), ("black" if luminance > 0.5 else "white")
        ax.text(j, i, text, ha="center", va="center", color=color, fontsize=fontsize)


# ---------------------------------------------------------------------------------------------


def _matrix_labels(tokens_q, tokens_k, lq, lk, about, q_name="tokens_q"):
    """Row and column labels of an ``(Lq, Lk)`` matrix (``about``: what the messages say of its
    shape); the keys default to the query tokens when the matrix is square."""
    labels_q = _check_tokens(tokens_q, lq, q_name, f"one per query row, {about}")
    if tokens_k is None and labels_q is not None and lq == lk:
        return labels_q, labels_q
    return labels_q, _check_tokens(tokens_k, lk, "tokens_k", f"one per key column, {about}")


@shared_doc(agg_setup=_AGG_SETUP)
def plot_attention(
    weights,
    tokens_q=None,
    tokens_k=None,
    ax=None,
    annotate=None,
    *,
    title=None,
    cmap="viridis",
    vmin=None,
    vmax=None,
    colorbar=True,
):
    """Heatmap of one attention matrix: rows are queries, columns keys.

    * ``weights``: ``(Lq, Lk)`` real array (leading axes of size 1, e.g. ``(1, 1, Lq, Lk)``,
      are dropped; for several heads use :func:`plot_heads`).
    * ``tokens_q`` / ``tokens_k``: labels of the rows / columns (``Lq`` / ``Lk`` of them);
      ``tokens_k`` defaults to ``tokens_q`` when the matrix is square (self-attention).
    * ``annotate``: write the values in the cells; ``None`` (default) means ``True`` when both
      sides have at most 12 entries.
    * ``vmin``/``vmax``: colour limits (default: the data's range); ``colorbar`` adds a colour bar.

    The image data (``ax.images[0].get_array()``) is exactly ``weights``.  Returns the ``Axes``.

    Examples
    --------
    <agg_setup>
    >>> ax = viz.plot_attention(np.full((3, 3), 1 / 3), ["a", "b", "c"])
    >>> ax.get_xticklabels()[0].get_text()
    'a'
    """
    w = _squeeze_leading(
        _real_array(weights, "weights"), 2, "weights", "(Lq, Lk) (one head; use plot_heads for (H, Lq, Lk))"
    )
    lq, lk = w.shape
    if lq == 0 or lk == 0:
        raise ValueError(f"weights: expected a non-empty matrix, got shape {w.shape}")
    labels_q, labels_k = _matrix_labels(tokens_q, tokens_k, lq, lk, f"weights is {w.shape}")
    annotate = _check_bool_or_none(annotate, "annotate")
    if annotate is None:
        annotate = lq <= ANNOTATE_MAX and lk <= ANNOTATE_MAX
    if title is not None and not isinstance(title, str):
        raise TypeError(f"title: expected a string or None, got {type(title).__name__}")
    plt = _pyplot()
    ax = _new_ax(ax, _cell_figsize(lq, lk, base=0.6 if annotate else 0.35))
    im = ax.imshow(w, cmap=cmap, vmin=vmin, vmax=vmax, aspect="auto", interpolation="nearest")
    _set_ticks(ax, labels_q, labels_k, lq, lk)
    ax.set_xlabel("key")
    ax.set_ylabel("query")
    if title is not None:
        ax.set_title(title)
    if annotate:
        _annotate(ax, w, im)
    if colorbar:
        plt.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    return ax


@shared_doc(agg_setup=_AGG_SETUP)
def plot_heads(
    weights, tokens=None, *, tokens_k=None, ncols=None, annotate=False, title=None, cmap="viridis", shared_scale=True
):
    """One heatmap panel per attention head, in a new figure.

    * ``weights``: ``(H, Lq, Lk)`` or ``(1, H, Lq, Lk)`` (one batch element; for a batch pass
      ``weights[b]``); a single ``(Lq, Lk)`` matrix counts as one head.
    * ``tokens``: labels of the query rows; also used for the key columns when square, or give
      ``tokens_k``.
    * ``ncols``: panels per row (default: all heads in one row up to 4, then rows of 4).
    * ``shared_scale``: one colour range for all heads (default), so panels compare directly.

    The figure holds exactly ``H`` Axes (no colour bar axes), in head order, each titled
    ``head h``.  Returns the ``Figure``.

    Examples
    --------
    <agg_setup>
    >>> fig = viz.plot_heads(np.full((2, 3, 3), 1 / 3))       # one panel per head
    >>> len(fig.axes) >= 2
    True
    """
    w = _real_array(weights, "weights")
    if w.ndim == 2:
        w = w[None]
    elif w.ndim == 4:
        if w.shape[0] != 1:
            raise ValueError(
                f"weights: expected (H, Lq, Lk) or (1, H, Lq, Lk), got a batch of "
                f"{w.shape[0]} in shape {w.shape}; pass one element, e.g. weights[0]"
            )
        w = w[0]
    if w.ndim != 3:
        raise ValueError(f"weights: expected shape (H, Lq, Lk) or (1, H, Lq, Lk), got {w.shape}")
    h, lq, lk = w.shape
    if h == 0 or lq == 0 or lk == 0:
        raise ValueError(f"weights: expected at least one head and a non-empty matrix, got shape {w.shape}")
    labels_q, labels_k = _matrix_labels(tokens, tokens_k, lq, lk, f"weights is {w.shape}", q_name="tokens")
    if ncols is None:
        ncols = h if h <= 4 else 4
    elif isinstance(ncols, bool) or not isinstance(ncols, numbers.Integral) or ncols < 1:
        raise ValueError(f"ncols: expected a positive integer or None, got {ncols!r}")
    ncols = min(int(ncols), h)
    annotate = _check_bool_or_none(annotate, "annotate")
    plt = _pyplot()
    nrows = math.ceil(h / ncols)
    panel = min(4.0, max(2.2, 0.3 * max(lq, lk) + 1.2))
    fig, axes = plt.subplots(
        nrows,
        ncols,
        figsize=(panel * ncols, panel * nrows + (0.4 if title else 0)),
        squeeze=False,
        layout="constrained",
    )
    vmin, vmax = (np.nanmin(w), np.nanmax(w)) if shared_scale else (None, None)
    for i, ax in enumerate(axes.flat):
        if i >= h:
            fig.delaxes(ax)
            continue
        im = ax.imshow(w[i], cmap=cmap, vmin=vmin, vmax=vmax, aspect="auto", interpolation="nearest")
        ax.set_title(f"head {i}")
        if labels_k is not None:  # labels under the lowest panel of each column only
            if i + ncols >= h:
                _set_ticks(ax, None, labels_k, lq, lk)
            else:
                ax.set_xticks([])
        if labels_q is not None:  # and beside the first panel of each row
            if i % ncols == 0:
                _set_ticks(ax, labels_q, None, lq, lk)
            else:
                ax.set_yticks([])
        if annotate:
            _annotate(ax, w[i], im, fontsize=7)
    if title is not None:
        fig.suptitle(str(title))
    return fig


@shared_doc(agg_setup=_AGG_SETUP)
def plot_mask(mask, tokens_q=None, tokens_k=None, ax=None, *, title=None):
    """Picture of an attention mask, rows queries and columns keys.

    * bool mask, **True = may attend** (npattn's polarity): allowed cells dark, blocked light;
    * float (additive) mask: ``-inf`` cells are blocked (light grey), finite values coloured.

    Leading axes of size 1 are dropped (``masks.from_key_padding_mask`` gives ``(b, 1, 1, Lk)``:
    pass one batch element).  Integer masks raise ``TypeError``, as everywhere in npattn.
    The image data is the mask as floats (1/0 for bool).  Returns the ``Axes``.

    Examples
    --------
    <agg_setup>
    >>> from npattn import masks
    >>> ax = viz.plot_mask(masks.causal(4))
    >>> type(ax).__name__
    'Axes'
    """
    if mask is None:
        raise TypeError("mask: expected a bool or float array, got None")
    m = to_numpy(mask)
    if m.dtype.kind in "iu":
        raise TypeError(
            f"mask: integer masks are ambiguous; pass bool (True = may attend) or float (additive), got dtype {m.dtype}"
        )
    if m.dtype != bool and m.dtype.kind != "f":
        raise TypeError(f"mask: expected a bool or float array, got dtype {m.dtype}")
    if m.ndim == 1:
        m = m[None]
    m = _squeeze_leading(m, 2, "mask", "(Lq, Lk)")
    lq, lk = m.shape
    if lq == 0 or lk == 0:
        raise ValueError(f"mask: expected a non-empty matrix, got shape {m.shape}")
    labels_q, labels_k = _matrix_labels(tokens_q, tokens_k, lq, lk, f"mask is {m.shape}")
    if m.dtype.kind == "f" and np.isnan(m).any():
        raise ValueError("mask: a float mask must not contain NaN")
    plt = _pyplot()
    from matplotlib.colors import ListedColormap

    ax = _new_ax(ax, _cell_figsize(lq, lk, base=0.4))
    if m.dtype == bool:
        data = m.astype(np.float64)
        im = ax.imshow(
            data, cmap=ListedColormap(["#eeeeee", "#2b6ca3"]), vmin=0, vmax=1, aspect="auto", interpolation="nearest"
        )
        default_title = "mask (dark = may attend)"
    else:
        data = m.astype(np.float64)
        cmap = plt.get_cmap("viridis").with_extremes(bad="#eeeeee")
        shown = np.ma.masked_invalid(data)
        im = ax.imshow(shown, cmap=cmap, aspect="auto", interpolation="nearest")
        finite = data[np.isfinite(data)]
        if finite.size and np.ptp(finite) > 0:
            plt.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
        default_title = "additive mask (grey = -inf)"
    # cell borders
    ax.set_xticks(np.arange(-0.5, lk, 1), minor=True)
    ax.set_yticks(np.arange(-0.5, lq, 1), minor=True)
    ax.grid(which="minor", color="white", linewidth=1)
    ax.tick_params(which="minor", length=0)
    _set_ticks(ax, labels_q, labels_k, lq, lk)
    ax.set_xlabel("key")
    ax.set_ylabel("query")
    ax.set_title(default_title if title is None else str(title))
    return ax


def _gradcheck_rows(report):
    """``[(label, max_rel_err, ok)]`` and the rtol from a report or a sequence of reports."""
    if hasattr(report, "rows"):
        reports, prefix = [report], False
    elif isinstance(report, (list, tuple)) and report and all(hasattr(r, "rows") for r in report):
        reports, prefix = list(report), True
    else:
        raise TypeError(
            "report: expected a GradcheckReport (from npattn.gradcheck) or a non-empty list "
            f"of them, got {type(report).__name__}"
        )
    rows, rtols = [], []
    for r in reports:
        rtol = getattr(r, "rtol", None)
        if rtol is not None:
            rtols.append(float(rtol))
        for row in r.rows:
            try:
                name, rel, ok = row[0], float(row[2]), bool(row[3])
            except (TypeError, IndexError, ValueError):
                raise TypeError(f"report: expected rows of (name, max_abs_err, max_rel_err, ok), got {row!r}") from None
            target = getattr(r, "target", "")
            rows.append((f"{target}: {name}" if prefix and target else str(name), rel, ok))
    if not rows:
        raise ValueError("report: no rows to plot (nothing was checked)")
    return rows, rtols


@shared_doc(agg_setup=_AGG_SETUP)
def plot_gradcheck(report, ax=None, *, rtol=None, title=None):
    """Bar chart of each checked tensor's maximum relative error (log scale), with the ``rtol`` line.

    * ``report``: a :class:`npattn.gradcheck.GradcheckReport`, or a list of them (bars are then
      labelled ``target: name``).
    * ``rtol``: where to draw the pass line (default: the report's own ``rtol``).

    Passing rows are green, failing ones red; an error of exactly 0 is drawn at a floor value
    below the smallest non-zero one and labelled ``0``.  Returns the ``Axes``.

    Examples
    --------
    <agg_setup>
    >>> import npattn
    >>> report = npattn.gradcheck(npattn.Linear(2, 2, rng=0), np.ones((1, 2)))
    >>> ax = viz.plot_gradcheck(report)
    >>> type(ax).__name__
    'Axes'
    """
    rows, rtols = _gradcheck_rows(report)
    if rtol is None:
        rtol = max(rtols) if rtols else None
    elif isinstance(rtol, bool) or not isinstance(rtol, numbers.Real) or not rtol > 0:
        raise ValueError(f"rtol: expected a positive number or None, got {rtol!r}")
    names = [r[0] for r in rows]
    rel = np.array([r[1] for r in rows], dtype=np.float64)
    ok = [r[2] for r in rows]
    positive = rel[np.isfinite(rel) & (rel > 0)]
    floor = (positive.min() if positive.size else (rtol or 1e-10)) / 100.0
    floor = min(floor, (rtol or 1.0) / 1e4)
    top = positive.max() if positive.size else 1.0
    shown = np.where(np.isfinite(rel), np.maximum(rel, floor), max(top, rtol or 0, 1.0) * 10)
    _pyplot()  # a clear ImportError without matplotlib
    ax = _new_ax(ax, (max(4.5, 0.45 * len(rows) + 2.0), 3.6))
    colors = ["#3a9d5d" if k else "#d1495b" for k in ok]
    x = np.arange(len(rows))
    base = floor / 10
    ax.bar(x, shown - base, color=colors, bottom=base)  # bar tops at the errors on a log axis
    ax.set_yscale("log")
    for xi, value, s in zip(x, rel, shown):
        if value == 0:
            ax.text(xi, s, "0", ha="center", va="bottom", fontsize=8)
        elif not np.isfinite(value):
            ax.text(xi, s, "inf", ha="center", va="bottom", fontsize=8)
    if rtol is not None:
        ax.axhline(rtol, color="black", linestyle="--", linewidth=1, label=f"rtol = {rtol:g}")
        ax.legend(loc="upper right", fontsize=8)
    ax.set_xticks(x)
    ax.set_xticklabels(names, **_slant(len(rows) > 3 or max(map(len, names)) > 10))
    ax.set_ylabel("max relative error")
    if title is None:
        target = getattr(report, "target", "") if hasattr(report, "rows") else ""
        verdict = "ok" if all(ok) else "FAILED"
        title = f"gradcheck {target}: {verdict}".replace("  ", " ")
    ax.set_title(str(title))
    return ax


def _smooth(y, smoothing):
    """Moving average (int window) or exponential moving average (float in (0, 1))."""
    if isinstance(smoothing, (bool, np.bool_)):
        raise TypeError(f"smoothing: expected None, an int window or a float in (0, 1), got {smoothing!r}")
    if isinstance(smoothing, numbers.Integral):
        n = int(smoothing)
        if n < 1:
            raise ValueError(f"smoothing: expected a window >= 1, got {n}")
        if n == 1:
            return y
        return _moving_average(y, n)
    if isinstance(smoothing, numbers.Real):
        beta = float(smoothing)
        if not 0.0 < beta < 1.0:
            raise ValueError(f"smoothing: expected a float in (0, 1) (EMA factor) or an int window, got {beta}")
        out = np.empty(len(y))
        acc, norm = 0.0, 0.0
        for i, v in enumerate(np.asarray(y, dtype=np.float64)):  # bias-corrected, as TensorBoard
            if not math.isfinite(v):  # a NaN/inf loss is shown as it is and kept out of the average
                out[i] = v
                continue
            acc = beta * acc + (1 - beta) * v
            norm = beta * norm + (1 - beta)
            out[i] = acc / norm
        return out
    raise TypeError(f"smoothing: expected None, an int window or a float in (0, 1), got {type(smoothing).__name__}")


def _moving_average(y, n):
    """Trailing moving average over ``n`` values (shorter windows at the start).

    Each window is summed on its own (no running cumsum), so a NaN or inf only affects the
    windows that contain it, and a huge value cannot cancel later windows to 0 by rounding.
    Costs ``len(y) * n`` additions, done as ``n`` shifted vector adds.
    """
    y = np.asarray(y, dtype=np.float64)
    L = len(y)
    total = np.zeros(L)
    with np.errstate(invalid="ignore", over="ignore"):  # inf - inf inside a window gives NaN there only
        for s in range(min(n, L)):  # add y[i - s] into window i
            total[s:] += y[: L - s]
    count = np.minimum(np.arange(1, L + 1), n)
    return total / count


@shared_doc(agg_setup=_AGG_SETUP)
def plot_loss(history, smoothing=None, ax=None, *, logy=False, title=None, xlabel="step", ylabel="loss"):
    """Loss curve(s).

    * ``history``: a 1-D sequence of losses, or a dict ``{label: sequence}`` for several curves
      (e.g. train and validation); each may also be a list of ``(step, loss)`` pairs.
    * ``smoothing``: ``None`` (raw curve); an ``int`` window for a trailing moving average; a
      ``float`` in (0, 1) for an exponential moving average.  When smoothing, the raw curve is
      drawn faintly behind the smoothed one.  A NaN/inf loss spoils only the moving-average
      windows that contain it (each window is summed on its own), and the exponential average
      shows it at its own step and skips it afterwards.
    * ``logy``: logarithmic loss axis.

    Returns the ``Axes``; its first line of each curve holds the raw values.

    Examples
    --------
    <agg_setup>
    >>> ax = viz.plot_loss([3.0, 2.0, 1.5, 1.2])
    >>> ax.get_ylabel()
    'loss'
    """
    if isinstance(history, dict):
        if not history:
            raise ValueError("history: expected a non-empty dict of {label: losses}")
        curves = list(history.items())
    else:
        curves = [(None, history)]
    parsed = []
    for label, values in curves:
        name = "history" if label is None else f"history[{label!r}]"
        a = _real_array(values, name)
        if a.ndim == 2 and a.shape[1] == 2:
            x, y = a[:, 0], a[:, 1]
        elif a.ndim == 1:
            x, y = np.arange(len(a), dtype=np.float64), a
        else:
            raise ValueError(f"{name}: expected a 1-D sequence of losses or (step, loss) pairs, got shape {a.shape}")
        if y.size == 0:
            raise ValueError(f"{name}: expected at least one loss value, got none")
        parsed.append((label, x, y))
    if smoothing is not None:
        for label, x, y in parsed:  # validate before drawing
            _smooth(y[:1], smoothing)
    if logy and any((y[np.isfinite(y)] <= 0).any() for _, _, y in parsed):
        raise ValueError("logy: losses must be positive for a logarithmic axis")
    ax = _new_ax(ax, (6.0, 3.6))
    for idx, (label, x, y) in enumerate(parsed):
        color = f"C{idx}"
        if smoothing is None:
            ax.plot(x, y, color=color, label=label)
        else:
            ax.plot(x, y, color=color, alpha=0.25, linewidth=1)
            ax.plot(
                x, _smooth(y, smoothing), color=color, linewidth=2, label=label if label is not None else "smoothed"
            )
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title is not None:
        ax.set_title(str(title))
    if any(label is not None for label, _, _ in parsed) or smoothing is not None:
        ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return ax
