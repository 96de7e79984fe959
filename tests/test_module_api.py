"""The public module API: saved states as a stack (shared weights), the documented hooks,
``Module.jvp``, ``Sequential`` and ``ModuleList``."""

import inspect
import warnings

import numpy as np
import pytest

import npattn
import npattn.functional as F
from npattn.nn.containers import ModuleList as ContainersModuleList
from npattn.nn.module import ModuleList as ModuleModuleList
from npattn.nn.module import ParamTangents
from npattn.testing import gradcheck

RNG = np.random.default_rng(11)


def rand(*shape):
    return RNG.standard_normal(shape)


# ----------------------------------------------------------------------------- shared weights


class TwiceNorm(npattn.Module):
    """``y = ln(lin(ln(x)))``: one LayerNorm used twice in one forward."""

    def __init__(self, d):
        super().__init__()
        self.ln = npattn.LayerNorm(d)
        self.lin = npattn.Linear(d, d, rng=0)

    def forward(self, x):
        y = self.ln(self.lin(self.ln(x)))
        self.save_for_backward(None)
        return y

    def backward(self, dy):
        self.pop_saved()
        return self.ln.backward(self.lin.backward(self.ln.backward(dy)))


def test_a_module_used_twice_gets_both_gradients():
    m = TwiceNorm(4)
    m.ln.weight.data = 1 + 0.3 * rand(4)
    m.ln.bias.data = rand(4)
    x = rand(2, 3, 4)
    assert gradcheck(m, x).ok  # both uses' gradients add into ln.weight / ln.bias
    # against the same net built from two separate (equal) LayerNorms
    y = m(x)
    assert m.ln.num_saved == 2
    dy = rand(*y.shape)
    m.zero_grad()
    dx = m.backward(dy)
    assert m.ln.num_saved == 0
    ln1, ln2 = npattn.LayerNorm(4), npattn.LayerNorm(4)
    ln1.load_state_dict(m.ln.state_dict())
    ln2.load_state_dict(m.ln.state_dict())
    y2 = ln2(m.lin(ln1(x)))
    np.testing.assert_allclose(y2, y, rtol=1e-14)
    m.lin.zero_grad()
    dx2 = ln1.backward(m.lin.backward(ln2.backward(dy)))
    np.testing.assert_allclose(dx, dx2, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(m.ln.weight.grad, ln1.weight.grad + ln2.weight.grad, rtol=1e-12)
    np.testing.assert_allclose(m.ln.bias.grad, ln1.bias.grad + ln2.bias.grad, rtol=1e-12)


def test_tied_linear_in_a_sequential():
    lin = npattn.Linear(3, 3, rng=1)
    net = npattn.Sequential(lin, npattn.RMSNorm(3), lin)
    assert gradcheck(net, rand(2, 3), mode="both").ok
    assert [n for n, _ in net.named_parameters()] == ["0.weight", "0.bias", "1.weight", "2.weight", "2.bias"]
    assert list(net.state_dict()) == ["0.weight", "0.bias", "1.weight", "2.weight", "2.bias"]


def test_states_are_consumed_latest_first_and_an_empty_stack_raises():
    ln = npattn.LayerNorm(3)
    x1, x2 = rand(2, 3), rand(4, 3)
    ln(x1)
    ln(x2)
    assert ln.num_saved == 2
    assert ln.backward(np.ones((4, 3))).shape == (4, 3)  # the second call's state
    assert ln.backward(np.ones((2, 3))).shape == (2, 3)  # then the first's
    with pytest.raises(RuntimeError, match="no forward state"):
        ln.backward(np.ones((2, 3)))
    with pytest.raises(ValueError, match="dy: expected shape"):  # dy is checked against the latest
        ln(x1)
        ln.backward(np.ones((4, 3)))
    assert ln.num_saved == 1  # a refused dy releases nothing
    ln.clear_saved()
    assert ln.num_saved == 0 and ln._cache is None


def test_no_grad_keeps_nothing_and_releases_earlier_states():
    """A forward under no_grad releases what earlier forwards kept: backward after it raises."""
    net = npattn.Sequential(npattn.Linear(3, 3, rng=0), npattn.LayerNorm(3))
    net(rand(2, 3))
    net(rand(2, 3))
    with npattn.no_grad():
        net(rand(5, 3))
    assert all(m.num_saved == 0 for m in net.modules())
    with pytest.raises(RuntimeError, match="no_grad"):
        net.backward(np.ones((2, 3)))
    net(rand(2, 3))  # a new forward allows a backward again
    assert net.backward(np.ones((2, 3))).shape == (2, 3)


def test_versions_are_checked_per_state():
    lin = npattn.Linear(2, 2, rng=0)
    lin(rand(1, 2))
    lin.weight.data = lin.weight.data + 1  # an optimizer step between forward and backward
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        lin.backward(np.ones((1, 2)))
    with pytest.raises(RuntimeError, match="modified"):
        lin.jvp(rand(1, 2))
    with pytest.raises(RuntimeError, match="modified"):
        lin.saved_state()


def test_to_and_clear_saved_release_states_of_submodules():
    net = npattn.Sequential(npattn.Linear(2, 2, rng=0), npattn.LayerNorm(2))
    net(rand(3, 2))
    assert all(m.num_saved == 1 for m in net.modules())
    net.clear_saved()
    assert all(m.num_saved == 0 for m in net.modules())
    net(rand(3, 2))
    net.to(np.float32)
    assert all(m._cache is None for m in net.modules())


# ----------------------------------------------------------------------------- the hooks


class Affine(npattn.Module):
    """A user's module written with the public hooks only (and forward mode)."""

    def __init__(self, d):
        super().__init__()
        self.scale = npattn.Parameter(np.linspace(0.5, 1.5, d))

    def forward(self, x):
        self.save_for_backward(x)
        return x * self.scale.data

    def backward(self, dy):
        x = self.pop_saved()
        self.accumulate_grad(self.scale, np.sum(dy * x, axis=tuple(range(x.ndim - 1))))
        return dy * self.scale.data

    def _jvp(self, x, input_tangents, param_tangents):
        (tx,) = input_tangents or (None,)
        t = np.zeros_like(x)
        if tx is not None:
            t = t + tx * self.scale.data
        ts = param_tangents.get(self.scale)
        if ts is not None:
            t = t + x * ts
        return t


def test_public_hooks_make_a_module_gradcheck_in_both_modes():
    assert gradcheck(Affine(4), rand(2, 3, 4), mode="both").ok


def test_the_protocol_has_one_spelling_the_public_one():
    for private in ("_save", "_pop", "_accumulate"):
        assert not hasattr(npattn.Module, private), private
    for public in ("save_for_backward", "pop_saved", "accumulate_grad"):
        assert callable(getattr(npattn.Module, public)), public


def test_module_does_not_import_containers():
    """containers.py builds on module.py; module.py imports nothing of containers.py (no circle)."""
    import ast
    import inspect

    import npattn.nn.module as module_file

    imported = set()
    for node in ast.walk(ast.parse(inspect.getsource(module_file))):
        if isinstance(node, ast.ImportFrom):
            imported.add(node.module or "")
            imported.update(a.name for a in node.names)
        elif isinstance(node, ast.Import):
            imported.update(a.name for a in node.names)
    assert not {name for name in imported if "containers" in name}


def test_saved_state_peeks_without_consuming():
    m = Affine(2)
    x1, x2 = rand(3, 2), rand(3, 2)
    m(x1)
    m(x2)
    assert m.saved_state() is x2 and m.saved_state(-2) is x1 and m.num_saved == 2
    with pytest.raises(RuntimeError, match="out of range"):
        m.saved_state(-3)
    with pytest.raises(TypeError, match="index"):
        m.saved_state(1.0)
    m.clear_saved()
    with pytest.raises(RuntimeError, match="no forward state"):
        m.saved_state()


def test_accumulate_grad_recreates_a_none_grad_and_skips_none():
    p = npattn.Parameter(np.ones(3))
    p.grad = None
    npattn.Module.accumulate_grad(p, np.full(3, 2.0))
    npattn.Module.accumulate_grad(p, None)
    npattn.Module.accumulate_grad(p, np.ones(3))
    np.testing.assert_array_equal(p.grad, [3.0, 3.0, 3.0])


def test_every_public_method_has_a_docstring():
    for cls in (npattn.Module, npattn.Parameter, npattn.Sequential, npattn.ModuleList):
        for name, member in inspect.getmembers(cls):
            if name.startswith("_"):
                continue
            if callable(member) or isinstance(member, property):
                assert (member.__doc__ or "").strip(), f"{cls.__name__}.{name} has no docstring"


# ----------------------------------------------------------------------------- jvp plumbing


def test_jvp_keeps_the_state_for_a_backward():
    lin = npattn.Linear(3, 2, rng=0)
    x = rand(4, 3)
    y = lin(x)
    tx, tw = rand(4, 3), rand(2, 3)
    t = lin.jvp(tx, param_tangents={"weight": tw})
    np.testing.assert_allclose(t, tx @ lin.weight.data.T + x @ tw.T, rtol=1e-13)
    assert lin.num_saved == 1
    np.testing.assert_allclose(lin.jvp(), np.zeros_like(y))  # no tangent: zero
    assert lin.backward(np.ones_like(y)).shape == x.shape


def test_jvp_errors():
    lin = npattn.Linear(3, 2, rng=0)
    with pytest.raises(RuntimeError, match="Linear.jvp: no forward state"):
        lin.jvp(rand(1, 3))
    lin(rand(1, 3))
    with pytest.raises(ValueError, match="unknown parameter 'weigth'"):
        lin.jvp(param_tangents={"weigth": rand(2, 3)})
    with pytest.raises(ValueError, match=r"param_tangents\['weight'\]: expected shape \(2, 3\)"):
        lin.jvp(param_tangents={"weight": rand(3, 2)})
    with pytest.raises(TypeError, match="param_tangents"):
        lin.jvp(param_tangents=[rand(2, 3)])
    with pytest.raises(TypeError, match="at most one input tangent"):
        lin.jvp(rand(1, 3), rand(1, 3))
    emb = npattn.Embedding(4, 2, rng=0)
    emb(np.array([1, 2]))
    with pytest.raises(TypeError, match="token ids have no tangent"):
        emb.jvp(np.ones(2))


def test_tied_parameter_tangent_reaches_every_use():
    lin = npattn.Linear(2, 2, rng=3)
    net = npattn.Sequential(lin, lin)
    x = rand(3, 2)
    net(x)
    tw = rand(2, 2)
    with pytest.raises(ValueError, match="same \\(tied\\) parameter"):
        net.jvp(param_tangents={"0.weight": tw, "1.weight": tw})
    t = net.jvp(param_tangents={"1.weight": tw})  # either name: the parameter is one
    h = x @ lin.weight.data.T + lin.bias.data
    np.testing.assert_allclose(t, (x @ tw.T) @ lin.weight.data.T + h @ tw.T, rtol=1e-12)


def test_module_without_forward_mode_raises_not_implemented():
    class Plain(npattn.Module):
        def forward(self, x):
            self.save_for_backward(None)
            return x

        def backward(self, dy):
            self.pop_saved()
            return dy

    m = Plain()
    m(rand(2))
    with pytest.raises(NotImplementedError, match="Plain has no forward mode"):
        m.jvp(rand(2))
    seq = npattn.Sequential(npattn.Linear(2, 2, rng=0), Plain())
    seq(rand(1, 2))
    with pytest.raises(NotImplementedError, match="Plain"):
        seq.jvp(rand(1, 2))


def test_param_tangents_object():
    p = npattn.Parameter(np.ones(2))
    pt = ParamTangents({id(p): ("w", np.full(2, 3.0))})
    assert len(pt) == 1 and bool(pt) and pt.get(None) is None and "1 tangent" in repr(pt)
    np.testing.assert_array_equal(pt.get(p), [3.0, 3.0])
    assert pt.get(npattn.Parameter(np.ones(2))) is None


# ----------------------------------------------------------------------------- containers


def test_sequential_chain_backward_and_keys_as_torch():
    net = npattn.Sequential(npattn.Linear(4, 6, rng=0), npattn.FeedForward(6, 8, rng=1), npattn.LayerNorm(6))
    assert list(net.state_dict())[:4] == ["0.weight", "0.bias", "1.linear1.weight", "1.linear1.bias"]
    assert gradcheck(net, rand(2, 3, 4), mode="both").ok
    x = rand(2, 4)
    y = net(x)
    np.testing.assert_allclose(y, net[2](net[1](net[0](x))), rtol=1e-14)
    net.clear_saved()
    assert isinstance(net[1:], npattn.Sequential) and len(net[1:]) == 2 and net[-1] is net[2]
    assert "(0): Linear" in repr(net)


def test_sequential_from_an_ordered_dict_and_refusals():
    from collections import OrderedDict

    net = npattn.Sequential(OrderedDict(proj=npattn.Linear(2, 3, rng=0), norm=npattn.LayerNorm(3)))
    assert list(net.state_dict()) == ["proj.weight", "proj.bias", "norm.weight", "norm.bias"]
    assert gradcheck(net, rand(2, 2)).ok
    with pytest.raises(TypeError, match="expected a Module"):
        npattn.Sequential(npattn.Linear(2, 2), "relu")
    with pytest.raises(ValueError, match="without dots"):
        npattn.Sequential({"a.b": npattn.Linear(2, 2)})
    with pytest.raises(RuntimeError, match="Sequential.backward: no forward state"):
        net.backward(np.ones((2, 3)))


def test_sequential_starting_with_an_embedding():
    net = npattn.Sequential(npattn.Embedding(5, 4, rng=0), npattn.LayerNorm(4))
    ids = np.array([[0, 3, 4]])
    assert gradcheck(net, ids, mode="both").ok
    y = net(ids)
    assert net.backward(np.ones_like(y)) is None


def test_module_list_is_importable_from_both_places_and_names_children():
    assert npattn.ModuleList is ContainersModuleList is ModuleModuleList
    ml = npattn.ModuleList([npattn.Linear(2, 2, rng=0)])
    ml.append(npattn.LayerNorm(2)).extend([npattn.RMSNorm(2)])
    assert len(ml) == 3 and [type(m).__name__ for m in ml] == ["Linear", "LayerNorm", "RMSNorm"]
    assert list(ml.state_dict()) == ["0.weight", "0.bias", "1.weight", "1.bias", "2.weight"]
    sub = ml[1:]
    assert type(sub) is npattn.ModuleList and len(sub) == 2
    with pytest.raises(TypeError, match="ModuleList.append: expected a Module"):
        ml.append(3)
    with pytest.raises(NotImplementedError):
        ml(rand(2))


def test_functional_jvp_used_by_layers_matches_the_functional_op():
    ln = npattn.LayerNorm(5)
    ln.weight.data = rand(5)
    x, tx = rand(2, 5), rand(2, 5)
    ln(x)
    _, cache = F.layer_norm(x, ln.weight.data, ln.bias.data)
    np.testing.assert_allclose(ln.jvp(tx), F.layer_norm_jvp(cache, tx), rtol=1e-13)


@pytest.mark.parametrize("activation", ["relu", "gelu", "swiglu"])
def test_a_composite_used_twice_has_each_calls_forward_mode(activation):
    """FeedForward's _jvp reads its children's states with _child_jvp(child, -1): the state of
    the call being differentiated, not the latest of the child's stack."""
    ff = npattn.FeedForward(4, 8, activation=activation, dropout=0.2, rng=0)
    net = npattn.Sequential(ff, npattn.LayerNorm(4), ff)
    rep = gradcheck(net, rand(2, 3, 4), mode="both")
    assert rep.ok, str(rep)


class TwiceFF(npattn.Module):
    def __init__(self):
        super().__init__()
        self.ff = npattn.FeedForward(3, 5, activation="gelu", rng=1)

    def forward(self, x):
        y = self.ff(self.ff(x))
        self.save_for_backward(None)
        return y

    def backward(self, dy):
        self.pop_saved()
        return self.ff.backward(self.ff.backward(dy))

    def _jvp(self, state, input_tangents, param_tangents):
        t = self._child_jvp(self.ff, -2, input_tangents, param_tangents)  # the first call
        return self._child_jvp(self.ff, -1, (t,), param_tangents)


def test_child_jvp_counts_states_from_the_call():
    assert gradcheck(TwiceFF(), rand(2, 3), mode="both").ok


def test_jvp_argument_corners():
    lin = npattn.Linear(2, 2, rng=0)
    lin._check_versions()  # nothing saved: nothing to check
    x = rand(3, 2)
    lin(x)
    tx = rand(3, 2)
    np.testing.assert_allclose(lin.jvp(tx, param_tangents={"weight": None}), lin.jvp(tx))  # None: zero
    pt = lin._param_tangents({"bias": np.ones(2)})
    np.testing.assert_allclose(lin.jvp(param_tangents=pt), np.ones((3, 2)))  # a ParamTangents passes through
    seq = npattn.Sequential(npattn.Linear(2, 2, rng=0))
    seq(x)
    with pytest.raises(TypeError, match="at most one input tangent"):
        seq.jvp(x, x)


def test_sequential_jvp_needs_every_child_to_keep_a_state():
    class Stateless(npattn.Module):
        def forward(self, x):
            return x

        def backward(self, dy):
            return dy

    seq = npattn.Sequential(npattn.Linear(2, 2, rng=0), Stateless())
    y = seq(rand(1, 2))
    with pytest.raises(RuntimeError, match="Stateless kept no state"):
        seq.jvp(rand(1, 2))
    assert seq.backward(np.ones_like(y)).shape == (1, 2)


def test_forwards_without_backward_warn_once_they_pile_up():
    """An evaluation loop run outside no_grad keeps every forward's state (each waits for a
    backward); past SAVED_STATES_WARNING of them the module says so, once, and names the cure."""
    from npattn.nn import module as module_mod

    lin = npattn.Linear(3, 2, rng=0)
    x = np.random.default_rng(1).standard_normal((4, 3))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(module_mod.SAVED_STATES_WARNING - 1):
            lin(x)
        assert not caught
        for _ in range(3):
            lin(x)
    assert len(caught) == 1 and issubclass(caught[0].category, RuntimeWarning)
    assert "no_grad" in str(caught[0].message) and "clear_saved" in str(caught[0].message)
    lin.clear_saved()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with npattn.no_grad():
            for _ in range(2 * module_mod.SAVED_STATES_WARNING):
                lin(x)
