"""An independent central-difference gradient, to double-check ``npattn.gradcheck`` itself, and
the module-level identity of forward and reverse mode (``check_jvp_keeps_state``).

Deliberately tiny and separate from the package: it shares no code with ``npattn.gradcheck``.
"""

import numpy as np
from _oracles import rel_err


def fd_gradients(fun, arrays, eps=1e-6):
    """Central differences of the scalar ``fun(*arrays)`` w.r.t. each array in ``arrays``.

    Each array is copied to float64 first; ``fun`` receives the perturbed copies.  Returns a
    list of float64 gradients, one per array.
    """
    # C order: a parameter may be a view of a column-major fused array (nn.layers._stacked), whose
    # copy in numpy's default order would be column-major too and reshape(-1) below a copy of it
    arrays = [np.array(a, dtype=np.float64, copy=True, order="C") for a in arrays]
    grads = []
    for a in arrays:
        grad = np.empty(a.shape)
        flat, gflat = a.reshape(-1), grad.reshape(-1)  # views (a is a fresh contiguous copy)
        for i in range(flat.size):
            old = flat[i]
            flat[i] = old + eps
            up = float(fun(*arrays))
            flat[i] = old - eps
            down = float(fun(*arrays))
            flat[i] = old
            gflat[i] = (up - down) / (2 * eps)
        grads.append(grad)
    return grads


def fd_check(forward, backward, arrays, upstream, eps=1e-6, **kwargs):
    """Relative errors between ``backward(upstream, cache)`` and central differences of
    ``sum(forward(*arrays, **kwargs)[0] * upstream)`` (one per array, with a floor of 1e-3).

    Every array in ``arrays`` is differentiated (bind constants such as ids in a closure); the
    non-None gradients of ``backward`` must pair with them in order."""
    arrays = [np.asarray(a, dtype=np.float64) for a in arrays]
    out, cache = forward(*arrays, **kwargs)
    grads = backward(upstream, cache)
    if not isinstance(grads, tuple):
        grads = (grads,)
    grads = [g for g in grads if g is not None]
    assert len(grads) == len(arrays), f"{len(grads)} gradients for {len(arrays)} arrays"
    num = fd_gradients(lambda *xs: np.sum(forward(*xs, **kwargs)[0] * upstream), arrays, eps)
    return [rel_err(g, n) for g, n in zip(grads, num)]


def check_jvp_keeps_state(m, x, tx, param_tangents, rng):
    """A module's ``jvp`` after ``m(x)``: linear in its tangents (the input's ``tx`` and the
    parameters' ``param_tangents``, by name), zero without any, and it leaves the forward's state
    for ``backward``, whose gradients satisfy ``<dy, J t> = <J^T dy, t>`` for a random ``dy``; a
    second input tangent is refused."""
    import pytest

    y = m(x)
    both = m.jvp(tx, param_tangents=param_tangents)
    assert rel_err(both, m.jvp(tx) + m.jvp(param_tangents=param_tangents), floor=1.0) <= 1e-12
    assert not np.any(m.jvp())
    dy = rng.standard_normal(y.shape)
    dx = m.backward(dy)  # the state is still there after jvp
    grads = dict(m.named_parameters())
    lhs = np.sum(dy * both)
    rhs = np.sum(dx * tx) + sum(np.sum(grads[k].grad * t) for k, t in param_tangents.items())
    assert abs(lhs - rhs) <= 1e-12 * abs(lhs)
    with pytest.raises(TypeError, match="at most one input tangent"):
        m(x)
        m.jvp(tx, tx)
