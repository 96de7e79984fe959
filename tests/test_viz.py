"""npattn.viz: every plot renders with the Agg backend, returns what it documents, shows the data."""

import subprocess
import sys

import numpy as np
import pytest

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

import npattn  # noqa: E402
from npattn import viz  # noqa: E402
from npattn.functional import softmax  # noqa: E402

TOKENS = "Your journey starts with one step".split()


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def _weights(*shape, seed=0):
    return softmax(np.random.default_rng(seed).standard_normal(shape))[0]


def _render(fig):
    fig.canvas.draw()  # the Agg renderer really draws everything
    buf = np.asarray(fig.canvas.buffer_rgba())
    assert buf.shape[0] > 50 and buf.shape[1] > 50
    assert buf[..., :3].std() > 0  # not a blank canvas


def _ticklabels(labels):
    return [t.get_text() for t in labels]


def test_import_stays_numpy_only():
    code = "import sys, npattn, npattn.viz; assert 'matplotlib' not in sys.modules, 'matplotlib imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


# -- plot_attention ------------------------------------------------------------------------------


def test_plot_attention_image_ticks_and_annotations():
    w = _weights(6, 6)
    ax = viz.plot_attention(w, TOKENS)
    assert isinstance(ax, Axes)
    _render(ax.figure)
    np.testing.assert_array_equal(np.asarray(ax.images[0].get_array()), w)
    assert _ticklabels(ax.get_yticklabels()) == TOKENS
    assert _ticklabels(ax.get_xticklabels()) == TOKENS  # keys default to the query tokens
    texts = [t.get_text() for t in ax.texts]
    assert len(texts) == 36  # small matrix: annotated by default
    assert texts[0] == f"{w[0, 0]:.2f}"
    assert ax.get_xlabel() == "key" and ax.get_ylabel() == "query"


def test_plot_attention_large_not_annotated_and_cross_tokens():
    w = _weights(13, 20)
    ax = viz.plot_attention(w)
    assert len(ax.texts) == 0
    ax2 = viz.plot_attention(_weights(2, 3), tokens_q=["a", "b"], tokens_k=["x", "y", "z"], annotate=False)
    assert _ticklabels(ax2.get_xticklabels()) == ["x", "y", "z"]
    assert _ticklabels(ax2.get_yticklabels()) == ["a", "b"]
    assert len(ax2.texts) == 0


def test_plot_attention_into_given_axes_and_squeezes_singletons():
    fig, (a1, a2) = plt.subplots(1, 2)
    w = _weights(1, 1, 4, 5)
    out = viz.plot_attention(w, ax=a2, colorbar=False)
    assert out is a2 and not a1.images
    np.testing.assert_array_equal(np.asarray(a2.images[0].get_array()), w[0, 0])
    _render(fig)


def test_plot_attention_accepts_float32_and_lists():
    ax = viz.plot_attention([[0.5, 0.5], [1.0, 0.0]])
    np.testing.assert_array_equal(np.asarray(ax.images[0].get_array()), [[0.5, 0.5], [1.0, 0.0]])
    viz.plot_attention(_weights(3, 3).astype(np.float32))


@pytest.mark.parametrize(
    "bad, exc, match",
    [
        (np.zeros((2, 3, 3)), ValueError, "plot_heads"),
        (np.zeros(4), ValueError, "weights"),
        (np.zeros((0, 3)), ValueError, "non-empty"),
        (np.ones((3, 3), dtype=bool), TypeError, "plot_mask"),
        (np.ones((3, 3), dtype=complex), TypeError, "weights"),
        (None, TypeError, "weights"),
    ],
)
def test_plot_attention_rejects_bad_weights(bad, exc, match):
    with pytest.raises(exc, match=match):
        viz.plot_attention(bad)


def test_plot_attention_rejects_bad_tokens_and_options():
    w = _weights(3, 3)
    with pytest.raises(ValueError, match="tokens_q.*3 labels"):
        viz.plot_attention(w, ["a", "b"])
    with pytest.raises(TypeError, match="single string"):
        viz.plot_attention(w, "a b c")
    with pytest.raises(ValueError, match="tokens_k"):
        viz.plot_attention(_weights(3, 4), ["a", "b", "c"], ["x"])
    with pytest.raises(TypeError, match="annotate"):
        viz.plot_attention(w, annotate="yes")
    with pytest.raises(TypeError, match="ax"):
        viz.plot_attention(w, ax="left")


# -- plot_heads ----------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(4, 6, 6), (1, 4, 6, 6)])
def test_plot_heads_one_axes_per_head(shape):
    w = _weights(*shape)
    fig = viz.plot_heads(w, TOKENS)
    assert isinstance(fig, Figure)
    _render(fig)
    heads = w.reshape(-1, 6, 6)
    assert len(fig.axes) == 4
    for h, ax in enumerate(fig.axes):
        assert ax.get_title() == f"head {h}"
        np.testing.assert_array_equal(np.asarray(ax.images[0].get_array()), heads[h])
    assert _ticklabels(fig.axes[0].get_yticklabels()) == TOKENS
    assert _ticklabels(fig.axes[3].get_xticklabels()) == TOKENS
    # one colour scale for all panels
    assert len({ax.images[0].get_clim() for ax in fig.axes}) == 1


def test_plot_heads_grid_drops_unused_panels():
    fig = viz.plot_heads(_weights(6, 3, 5), ncols=4)
    assert len(fig.axes) == 6
    fig = viz.plot_heads(_weights(3, 4), annotate=True)  # one matrix = one head
    assert len(fig.axes) == 1 and len(fig.axes[0].texts) == 12


def test_plot_heads_rejects_bad_input():
    with pytest.raises(ValueError, match="weights\\[0\\]"):
        viz.plot_heads(_weights(2, 3, 4, 4))
    with pytest.raises(ValueError, match="tokens"):
        viz.plot_heads(_weights(2, 4, 4), ["a"])
    with pytest.raises(ValueError, match="ncols"):
        viz.plot_heads(_weights(2, 4, 4), ncols=0)
    with pytest.raises(ValueError, match="weights"):
        viz.plot_heads(np.zeros(3))


# -- plot_mask -----------------------------------------------------------------------------------


def test_plot_mask_bool():
    m = npattn.masks.causal(6)
    ax = viz.plot_mask(m, TOKENS)
    assert isinstance(ax, Axes)
    _render(ax.figure)
    np.testing.assert_array_equal(np.asarray(ax.images[0].get_array()), m.astype(float))
    assert _ticklabels(ax.get_xticklabels()) == TOKENS


def test_plot_mask_float_and_padding_shapes():
    m = npattn.masks.to_additive(npattn.masks.sliding_window(5, 2))
    ax = viz.plot_mask(m)
    data = ax.images[0].get_array()
    np.testing.assert_array_equal(np.ma.getmaskarray(data), np.isinf(m))
    np.testing.assert_array_equal(np.asarray(data)[np.isfinite(m)], 0.0)
    _render(ax.figure)
    kpm = npattn.masks.from_key_padding_mask(~npattn.masks.padding([3, 5], 5))  # (2, 1, 1, 5)
    ax = viz.plot_mask(kpm[0])
    assert ax.images[0].get_array().shape == (1, 5)


def test_plot_mask_rejects_bad_input():
    with pytest.raises(TypeError, match="integer"):
        viz.plot_mask(np.tri(3, dtype=int))
    with pytest.raises(TypeError, match="mask"):
        viz.plot_mask(None)
    with pytest.raises(ValueError, match="NaN"):
        viz.plot_mask(np.full((2, 2), np.nan))
    with pytest.raises(ValueError, match="mask"):
        viz.plot_mask(np.ones((2, 3, 3), dtype=bool))


# -- plot_gradcheck ------------------------------------------------------------------------------


def test_plot_gradcheck_bars_and_rtol_line():
    report = npattn.gradcheck(npattn.Linear(3, 2, rng=0), np.random.default_rng(1).standard_normal((2, 3)))
    ax = viz.plot_gradcheck(report)
    assert isinstance(ax, Axes)
    _render(ax.figure)
    assert ax.get_yscale() == "log"
    assert _ticklabels(ax.get_xticklabels()) == [r.name for r in report.rows]
    tops = np.array([p.get_y() + p.get_height() for p in ax.patches])
    rel = np.array([r.max_rel_err for r in report.rows])
    np.testing.assert_allclose(tops[rel > 0], rel[rel > 0], rtol=1e-9)
    assert (tops[rel == 0] < rel[rel > 0].min()).all()  # an exact 0 (bias: exact differences) sits below
    assert any(np.allclose(line.get_ydata(), report.rtol) for line in ax.get_lines())
    assert "ok" in ax.get_title()


def test_plot_gradcheck_failing_rows_are_red_and_lists_of_reports():
    from npattn.functional import softmax_backward

    def broken_backward(dout, cache):
        return softmax_backward(dout, cache) * 1.01

    x = np.random.default_rng(0).standard_normal((2, 4))
    bad = npattn.gradcheck((softmax, broken_backward), x)
    good = npattn.gradcheck(softmax, x)
    assert not bad.ok and good.ok
    ax = viz.plot_gradcheck([good, bad])
    colors = [p.get_facecolor() for p in ax.patches]
    assert colors[0] != colors[1]
    assert len(ax.patches) == 2
    assert "FAILED" in ax.get_title()


def test_plot_gradcheck_rejects_non_reports():
    with pytest.raises(TypeError, match="GradcheckReport"):
        viz.plot_gradcheck({"x": 1e-9})
    with pytest.raises(TypeError, match="GradcheckReport"):
        viz.plot_gradcheck([])
    report = npattn.gradcheck(softmax, np.ones((1, 3)))
    with pytest.raises(ValueError, match="rtol"):
        viz.plot_gradcheck(report, rtol=-1)


# -- plot_loss -----------------------------------------------------------------------------------


def test_plot_loss_raw_and_smoothed():
    losses = 2.0 * np.exp(-np.arange(50) / 10) + 0.1 * np.random.default_rng(0).random(50)
    ax = viz.plot_loss(losses)
    assert isinstance(ax, Axes)
    _render(ax.figure)
    np.testing.assert_array_equal(ax.get_lines()[0].get_ydata(), losses)
    ax = viz.plot_loss(list(losses), smoothing=5)
    raw, smooth = ax.get_lines()
    np.testing.assert_array_equal(raw.get_ydata(), losses)
    np.testing.assert_allclose(smooth.get_ydata()[10], losses[6:11].mean())
    ax = viz.plot_loss(losses, smoothing=0.9, logy=True)
    assert ax.get_yscale() == "log"
    assert ax.get_lines()[1].get_ydata()[0] == pytest.approx(losses[0])


def test_plot_loss_dict_of_curves_and_step_pairs():
    ax = viz.plot_loss({"train": [3.0, 2.0, 1.0], "val": [[0, 3.2], [2, 1.5]]})
    assert [line.get_label() for line in ax.get_lines()] == ["train", "val"]
    np.testing.assert_array_equal(ax.get_lines()[1].get_xdata(), [0, 2])


@pytest.mark.parametrize(
    "history, kwargs, exc",
    [
        ([], {}, ValueError),
        (np.zeros((2, 3)), {}, ValueError),
        ({}, {}, ValueError),
        ([1.0, 2.0], {"smoothing": 0}, ValueError),
        ([1.0, 2.0], {"smoothing": 1.5}, ValueError),
        ([1.0, 2.0], {"smoothing": "ema"}, TypeError),
        ([1.0, 0.0], {"logy": True}, ValueError),
        (["a", "b"], {}, TypeError),
    ],
)
def test_plot_loss_rejects_bad_input(history, kwargs, exc):
    with pytest.raises(exc):
        viz.plot_loss(history, **kwargs)
