"""The safetensors reader and the shard index, read as strictly as the format's reference reader
(``safetensors/src/tensor.rs``: ``read_metadata`` and ``Metadata::validate``), and never outside
the model directory.

Every malformed file is written here byte by byte; a valid one comes from npattn's own
``save_safetensors``.  Where ``safetensors`` is installed, each case said to be refused by the
reference is also refused by its ``load_file``, and each accepted edge case loads there with the
same values.
"""

from __future__ import annotations

import gc
import json
import os

import numpy as np
import pytest

from npattn import no_grad
from npattn.models import CausalLM, hf
from npattn.models.hf import open_checkpoint, open_safetensors, save_safetensors

TINY = {
    "model_type": "llama",
    "vocab_size": 11,
    "hidden_size": 8,
    "intermediate_size": 12,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
}


def _file(path, header, data=b"") -> str:
    """A safetensors file written by hand: ``header`` (a dict, or the JSON text as str/bytes)
    after its 8-byte little-endian length, then ``data``."""
    if isinstance(header, dict):
        header = json.dumps(header)
    if isinstance(header, str):
        header = header.encode()
    with open(path, "wb") as f:
        f.write(len(header).to_bytes(8, "little") + header + data)
    return os.fspath(path)


def _t(shape, offsets, dtype="F32"):
    return {"dtype": dtype, "shape": shape, "data_offsets": offsets}


def _entry_text(**fields) -> str:
    """One header entry's JSON with each value given as raw JSON text (for NaN, duplicates)."""
    return "{" + ", ".join(f'"{k}": {v}' for k, v in fields.items()) + "}"


Z4, Z8, Z12 = b"\0" * 4, b"\0" * 8, b"\0" * 12
W = json.dumps(_t([1], [0, 4]))

# (id, header, data, message regex, refused by the reference reader too)
MALFORMED = [
    ("not-an-object", "[]", b"", "not a JSON object", True),
    ("not-json", "{]]]", b"", "not valid JSON", True),
    ("not-utf8", b'{"\xff": 1}', b"", "not UTF-8", True),
    ("nested-deep", '{"w": ' + "[" * 100_000 + "]" * 100_000 + "}", b"", "nests", True),
    (
        "duplicate-dtype",
        '{"w": {"dtype": "F32", "dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}',
        Z4,
        "duplicate key 'dtype'",
        True,
    ),
    ("duplicate-tensor", '{"w": %s, "w": %s}' % (W, W), Z4, "duplicate key 'w'", False),
    ("entry-not-object", {"w": 5}, b"", "tensor 'w' has a malformed header entry", True),
    (
        "no-offsets",
        {"w": {"dtype": "F32", "shape": [1]}},
        Z4,
        "tensor 'w' has a malformed header entry: no 'data_offsets'",
        True,
    ),
    (
        "no-dtype",
        {"w": {"shape": [1], "data_offsets": [0, 4]}},
        Z4,
        "tensor 'w' has a malformed header entry: no 'dtype'",
        True,
    ),
    ("unknown-dtype", {"w": _t([1], [0, 4], "X9")}, Z4, "tensor 'w' has dtype 'X9'", True),
    ("dtype-not-str", {"w": _t([1], [0, 4], 5)}, Z4, "tensor 'w' has dtype 5", True),
    ("shape-float", {"w": _t([1.7], [0, 4])}, Z4, r"tensor 'w'.*'shape'.*\[1\.7\]", True),
    ("shape-float-integral", {"w": _t([1.0], [0, 4])}, Z4, r"tensor 'w'.*'shape'.*\[1\.0\]", True),
    ("shape-str", {"w": _t(["1"], [0, 4])}, Z4, r"tensor 'w'.*'shape'.*\['1'\]", True),
    ("shape-bool", {"w": _t([True], [0, 4])}, Z4, r"tensor 'w'.*'shape'.*\[True\]", True),
    ("shape-negative", {"w": _t([-1, -4], [0, 16])}, Z8 * 2, r"tensor 'w'.*'shape'.*\[-1, -4\]", True),
    ("shape-not-list", {"w": _t(1, [0, 4])}, Z4, r"tensor 'w'.*'shape'", True),
    (
        "shape-5000-digits",
        '{"w": ' + _entry_text(dtype='"F32"', shape="[1" + "0" * 5000 + "]", data_offsets="[0, 4]") + "}",
        Z4,
        "oversized number",
        True,
    ),
    ("shape-nan", '{"w": ' + _entry_text(dtype='"F32"', shape="[NaN]", data_offsets="[0, 4]") + "}", Z4, "NaN", True),
    ("offsets-three", {"w": _t([1], [0, 4, 4])}, Z4, r"tensor 'w'.*'data_offsets'.*\[0, 4, 4\]", True),
    ("offsets-one", {"w": _t([1], [4])}, Z4, r"tensor 'w'.*'data_offsets'", True),
    ("offsets-float", {"w": _t([1], [0, 4.0])}, Z4, r"tensor 'w'.*'data_offsets'.*4\.0", True),
    ("offsets-bool", {"w": _t([1], [False, 4])}, Z4, r"tensor 'w'.*'data_offsets'.*False", True),
    ("offsets-str", {"w": _t([1], ["0", "4"])}, Z4, r"tensor 'w'.*'data_offsets'", True),
    ("offsets-negative", {"w": _t([1], [-4, 0])}, Z4, r"tensor 'w'.*'data_offsets'", True),
    ("too-few-bytes", {"w": _t([3], [0, 8])}, Z8, r"tensor 'w' \(F32 \[3\]\) needs 12 bytes", True),
    ("reversed-offsets", {"w": _t([0], [4, 0])}, Z4, r"tensor 'w' \(F32 \[0\]\) needs 0 bytes", True),
    (
        "gap-at-start",
        {"w": _t([1], [4, 8])},
        Z8,
        r"tensor 'w': its data_offsets \[4, 8\] leave a gap: bytes \[0, 4\)",
        True,
    ),
    (
        "gap-between",
        {"a": _t([1], [0, 4]), "b": _t([1], [8, 12])},
        Z12,
        r"tensor 'b': its data_offsets \[8, 12\] leave a gap: bytes \[4, 8\)",
        True,
    ),
    (
        "same-bytes",
        {"a": _t([1], [0, 4]), "b": _t([1], [0, 4])},
        Z4,
        r"tensor 'b': its data_offsets \[0, 4\] overlap tensor 'a'",
        True,
    ),
    (
        "overlap",
        {"a": _t([2], [0, 8]), "b": _t([1], [4, 8])},
        Z8,
        r"tensor 'b': its data_offsets \[4, 8\] overlap tensor 'a', which ends at byte 8",
        True,
    ),
    (
        "trailing-bytes",
        {"w": _t([1], [0, 4])},
        Z8,
        r"tensor 'w', the last, ends at byte 4.* 8 bytes of data.*\[4, 8\) belong to no tensor",
        True,
    ),
    (
        "truncated",
        {"a": _t([1], [0, 4]), "b": _t([2], [4, 12])},
        Z8,
        r"tensor 'b', the last, ends at byte 12.* 8 bytes of data.*truncated",
        True,
    ),
    ("data-without-tensors", {}, Z4, r"no tensors, but the file has 4 bytes of data", True),
    ("metadata-int-value", {"__metadata__": {"a": 1}, "w": _t([1], [0, 4])}, Z4, "'__metadata__'.*'a'", True),
    ("metadata-list", {"__metadata__": ["a"], "w": _t([1], [0, 4])}, Z4, "'__metadata__'", True),
    ("metadata-str", {"__metadata__": "a", "w": _t([1], [0, 4])}, Z4, "'__metadata__'", True),
]


@pytest.mark.parametrize("header, data, match", [pytest.param(h, d, m, id=i) for i, h, d, m, _ in MALFORMED])
def test_malformed_file_is_refused_naming_file_and_tensor(tmp_path, header, data, match):
    path = _file(tmp_path / "model.safetensors", header, data)
    with pytest.raises(ValueError, match=match) as info:
        open_safetensors(path)
    assert type(info.value) is ValueError
    assert str(info.value).startswith(path + ": ")


@pytest.mark.parametrize("header, data", [pytest.param(h, d, id=i) for i, h, d, _, refused in MALFORMED if refused])
def test_reference_reader_refuses_the_same_files(tmp_path, header, data):
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    from safetensors import SafetensorError

    path = _file(tmp_path / "model.safetensors", header, data)
    with pytest.raises(SafetensorError):
        safetensors_numpy.load_file(path)


# edge cases the reference accepts: so does npattn, with the same tensors (numpy has no bfloat16,
# so the reference's numpy API cannot convert one: its values are given)
BF16_ONE_MINUS_TWO = {"w": np.array([1.0, -2.0], np.float32)}
VALID_EDGES = [
    ("empty", {}, b""),
    ("offsets-not-in-name-order", {"b": _t([1], [4, 8]), "a": _t([1], [0, 4])}, np.arange(2, dtype="<f4").tobytes()),
    (
        "zero-size-tensors",
        {"e": _t([0, 3], [0, 0]), "w": _t([2], [0, 8]), "f": _t([4, 0], [8, 8])},
        np.ones(2, "<f4").tobytes(),
    ),
    ("metadata-null", {"__metadata__": None, "w": _t([1], [0, 4])}, np.ones(1, "<f4").tobytes()),
    ("unknown-field", {"w": dict(_t([2], [0, 4], "BF16"), extra=[1])}, np.array([0x3F80, 0xC000], "<u2").tobytes()),
    ("unknown-field-f32", {"w": dict(_t([2], [0, 8]), extra=[1])}, np.array([1, -2], "<f4").tobytes()),
    ("leading-space", " " + json.dumps({"w": _t([1], [0, 8], "F64")}), np.ones(1, "<f8").tobytes()),
]


@pytest.mark.parametrize("header, data", [pytest.param(h, d, id=i) for i, h, d in VALID_EDGES])
def test_edge_cases_the_reference_accepts(tmp_path, header, data):
    path = _file(tmp_path / "model.safetensors", header, data)
    got = {k: t.numpy() for k, t in open_safetensors(path).items()}
    if isinstance(header, dict) and "BF16" in json.dumps(header):
        expect = BF16_ONE_MINUS_TWO
        with open(path, "rb") as f:  # the reference reads the header alike
            pytest.importorskip("safetensors").deserialize(f.read())
    else:
        expect = pytest.importorskip("safetensors.numpy").load_file(path)
    assert sorted(got) == sorted(expect)
    for k in expect:
        assert got[k].dtype == expect[k].dtype and got[k].shape == expect[k].shape
        np.testing.assert_array_equal(got[k], expect[k])


def test_valid_file_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {
        "a": rng.standard_normal((3, 5)),
        "b": rng.standard_normal(7).astype(np.float32),
        "c": rng.integers(-9, 9, (2, 2, 2)).astype(np.int64),
        "empty": np.zeros((0, 4), np.float16),
    }
    path = tmp_path / "w.safetensors"
    save_safetensors(tensors, path, {"format": "np"})
    got = open_safetensors(path)
    assert list(got) == list(tensors)
    for k, v in tensors.items():
        np.testing.assert_array_equal(got[k].numpy(), v)
    st = pytest.importorskip("safetensors.numpy")
    ref = st.load_file(path)
    for k, v in tensors.items():
        np.testing.assert_array_equal(ref[k], v)


def test_header_length_is_never_printed(tmp_path):
    """A file that is not a safetensors file: its first 8 bytes read as a length must not appear
    in the message (they are the file's contents, e.g. ``root:x:0`` of /etc/passwd)."""
    passwd = b"root:x:0:0:root:/root:/bin/bash\ndaemon:x:1:1:daemon:/usr/sbin:/usr/sbin/nologin\n"
    small = (50_000_000).to_bytes(8, "little") + b"{}"  # plausible under the limit, beyond the file
    for i, content in enumerate((passwd, small)):
        path = tmp_path / f"f{i}.safetensors"
        path.write_bytes(content)
        with pytest.raises(ValueError, match="not a safetensors file") as info:
            open_safetensors(path)
        n = int.from_bytes(content[:8], "little")
        msg = str(info.value)
        assert str(n) not in msg and f"{n:,}" not in msg and hex(n) not in msg, msg
        assert "root" not in msg.replace(str(path), "")
    path = _file(tmp_path / "bytes.safetensors", b'{"\xfe\xff": 1}')
    with pytest.raises(ValueError, match="not UTF-8") as info:
        open_safetensors(path)
    assert "xfe" not in str(info.value).lower() and "254" not in str(info.value)


def test_header_over_the_reference_limit(tmp_path):
    """A header longer than 100,000,000 bytes is refused before it is read (the file is sparse:
    it is long enough to hold the header, so the limit, not the file size, refuses it)."""
    path = tmp_path / "big.safetensors"
    n = 100_000_001
    with open(path, "wb") as f:
        f.write(n.to_bytes(8, "little") + b"{")
        f.truncate(8 + n + 16)
    with pytest.raises(ValueError, match="not a safetensors file.*100,000,000"):
        open_safetensors(path)
    st = pytest.importorskip("safetensors.numpy")
    from safetensors import SafetensorError

    with pytest.raises(SafetensorError, match="too large"):
        st.load_file(path)


def test_names_and_shapes_in_messages_are_cut_short(tmp_path):
    """A header can hold megabytes in one name or shape: a message quotes at most a line of it."""
    name = "w" * 100_000
    path = _file(tmp_path / "long.safetensors", {name: _t([1.5] * 100_000, [0, 4])}, Z4)
    with pytest.raises(ValueError, match="shape") as info:
        open_safetensors(path)
    assert len(str(info.value)) < 600 + len(path)


def test_huge_shape_is_refused_quickly(tmp_path):
    """A shape whose product is astronomically large (a 2**(10**5)-element tensor) is refused
    without computing the product in full."""
    path = _file(tmp_path / "huge.safetensors", {"w": _t([2] * 100_000, [0, 4])}, Z4)
    with pytest.raises(ValueError, match=r"tensor 'w'.*needs more than 2\*\*64 bytes"):
        open_safetensors(path)


# -- the shard index -----------------------------------------------------------------------------
def _checkpoint(directory, weight_map, shards: dict) -> None:
    """``config.json``, the shard files ``{relative path: {name: array}}`` and an index."""
    os.makedirs(directory, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(TINY))
    for rel, tensors in shards.items():
        os.makedirs(os.path.dirname(os.path.join(directory, rel)) or directory, exist_ok=True)
        save_safetensors(tensors, os.path.join(directory, rel))
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.fixture
def opened(monkeypatch):
    """The paths ``open_safetensors`` is called with during the test."""
    calls: list = []
    real = hf.open_safetensors

    def recording(path):
        calls.append(os.fspath(path))
        return real(path)

    monkeypatch.setattr(hf, "open_safetensors", recording)
    return calls


def _outside(tmp_path):
    out = tmp_path / "outside"
    out.mkdir()
    save_safetensors({"b": np.ones(2, np.float32)}, out / "x.safetensors")
    return out


@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlinked-file", "symlinked-folder", "dotdot-inside-then-out"])
def test_shard_outside_the_directory_is_refused_before_opening_anything(tmp_path, opened, how):
    out = _outside(tmp_path)
    model = tmp_path / "model"
    model.mkdir()
    if how == "dotdot":
        shard = "../outside/x.safetensors"
    elif how == "absolute":
        shard = str(out / "x.safetensors")
    elif how == "symlinked-file":
        shard = "link.safetensors"
        os.symlink(out / "x.safetensors", model / shard)
    elif how == "symlinked-folder":
        os.symlink(out, model / "sub")
        shard = "sub/x.safetensors"
    else:
        (model / "sub").mkdir()
        shard = "sub/../../outside/x.safetensors"
    # a good shard sorts first: nothing at all may be opened
    _checkpoint(model, {"a": "a.safetensors", "b": shard}, {"a.safetensors": {"a": np.zeros(3, np.float32)}})
    with pytest.raises(ValueError, match="shard") as info:
        open_checkpoint(model)
    msg = str(info.value)
    assert repr(shard) in msg and "outside the model directory" in msg
    assert opened == []


def test_symlinks_that_stay_inside_are_followed(tmp_path):
    model = tmp_path / "model"
    _checkpoint(model, {"a": "link.safetensors"}, {"real/a.safetensors": {"a": np.arange(3.0)}})
    os.symlink(os.path.join("real", "a.safetensors"), model / "link.safetensors")
    _, tensors = open_checkpoint(model)
    np.testing.assert_array_equal(tensors["a"].numpy(), np.arange(3.0))
    # the model directory itself may be reached through a symlink
    os.symlink(model, tmp_path / "alias")
    _, tensors = open_checkpoint(tmp_path / "alias")
    np.testing.assert_array_equal(tensors["a"].numpy(), np.arange(3.0))


def test_hugging_face_cache_snapshot(tmp_path):
    """huggingface_hub's cache keeps a snapshot's files as symlinks into the repository's
    ``blobs`` folder (``models--org--name/snapshots/<revision>/f -> ../../blobs/<hash>``):
    those shards load; a blob folder elsewhere does not."""
    repo = tmp_path / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "0123abcd"
    snap.mkdir(parents=True)
    for name, value in (("a", np.arange(3.0)), ("b", np.ones(2))):
        save_safetensors({name: value}, repo / "blobs" / f"hash-{name}")
        os.symlink(os.path.join("..", "..", "blobs", f"hash-{name}"), snap / f"model-{name}.safetensors")
    (snap / "config.json").write_text(json.dumps(TINY))
    index = {"weight_map": {"a": "model-a.safetensors", "b": "model-b.safetensors"}}
    (snap / "model.safetensors.index.json").write_text(json.dumps(index))
    _, tensors = open_checkpoint(snap)
    np.testing.assert_array_equal(tensors["b"].numpy(), np.ones(2))
    # a snapshots folder does not open its repository's neighbours
    (tmp_path / "other").mkdir()
    save_safetensors({"b": np.ones(2)}, tmp_path / "other" / "x.safetensors")
    os.symlink(tmp_path / "other" / "x.safetensors", snap / "escape.safetensors")
    index["weight_map"]["b"] = "escape.safetensors"
    (snap / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="'escape.safetensors' is outside the model directory"):
        open_checkpoint(snap)


@pytest.mark.parametrize(
    "index_text, match",
    [
        pytest.param(json.dumps({"weight_map": ["a.safetensors"]}), "'weight_map' must map", id="weight-map-list"),
        pytest.param(json.dumps({"weight_map": {"a": 5}}), r"weight_map\['a'\].*got 5", id="value-int"),
        pytest.param(json.dumps({"weight_map": {"a": None}}), r"weight_map\['a'\].*got None", id="value-null"),
        pytest.param(json.dumps({"weight_map": {"a": ""}}), r"weight_map\['a'\].*got ''", id="value-empty"),
        pytest.param(json.dumps({"weight_map": {"a": "a\0.safetensors"}}), r"weight_map\['a'\]", id="value-nul"),
        pytest.param(json.dumps({"metadata": {}}), "no 'weight_map'", id="no-weight-map"),
        pytest.param("[]", "'weight_map'", id="not-an-object"),
        pytest.param('{"weight_map": ' + "[" * 100_000 + "]" * 100_000 + "}", "nests", id="nested-deep"),
        pytest.param('{"weight_map": {"a": "x.safetensors", "a": "y.safetensors"}}', "duplicate key 'a'", id="dup"),
        pytest.param("{not json", "not valid JSON", id="not-json"),
    ],
)
def test_malformed_index_is_refused_naming_the_key_or_file(tmp_path, opened, index_text, match):
    _checkpoint(tmp_path, {}, {"x.safetensors": {"a": np.zeros(1)}})
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(index_text)
    with pytest.raises(ValueError, match=match) as info:
        open_checkpoint(tmp_path)
    assert type(info.value) is ValueError
    assert str(info.value).startswith(f"{index}: ")
    assert opened == []


# -- nothing half-loaded -------------------------------------------------------------------------
def _tiny_state(seed=0):
    m = CausalLM(TINY, rng=seed)
    return m, m.state_dict()


def _mapped(path) -> bool:
    with open("/proc/self/maps") as f:
        return os.path.realpath(path) in f.read()


def test_a_failed_load_leaves_no_model_and_no_mapping(tmp_path):
    """The second shard is malformed (a gap before its tensor's data): from_pretrained raises
    naming it, and the first shard, opened before it, is no longer mapped once the error is gone."""
    _, sd = _tiny_state()
    first, second = list(sd)[:2]
    model = tmp_path / "model"
    _checkpoint(model, {first: "s0.safetensors", second: "s1.safetensors"}, {"s0.safetensors": {first: sd[first]}})
    nbytes = sd[second].nbytes
    code = {"float64": "F64", "float32": "F32"}[sd[second].dtype.name]
    _file(model / "s1.safetensors", {second: _t(list(sd[second].shape), [4, 4 + nbytes], code)}, b"\0" * (4 + nbytes))
    result, msg = None, ""
    try:
        result = CausalLM.from_pretrained(model)
    except ValueError as e:  # the name is unbound after the block: the traceback's frames go with it
        msg = str(e)
    assert result is None
    assert msg.startswith(f"{model / 's1.safetensors'}: tensor {second!r}") and "leave a gap" in msg
    gc.collect()
    if os.path.exists("/proc/self/maps"):
        assert not _mapped(model / "s0.safetensors")


def test_load_state_dict_from_a_file_is_atomic(tmp_path):
    """A state dict read from a safetensors file with one tensor of the wrong shape changes
    nothing; the same file with the shape right loads every tensor."""
    m, sd = _tiny_state(0)
    before = {k: v.copy() for k, v in m.state_dict().items()}
    _, other = _tiny_state(1)
    other = dict(other)
    last = list(other)[-1]
    other[last] = np.zeros(other[last].shape[:-1] + (other[last].shape[-1] + 1,), np.float32)
    save_safetensors(other, tmp_path / "w.safetensors")
    values = {k: t.numpy() for k, t in open_safetensors(tmp_path / "w.safetensors").items()}
    with pytest.raises(ValueError, match=last):
        m.load_state_dict(values)
    for k, v in m.state_dict().items():
        np.testing.assert_array_equal(v, before[k])
    _, good = _tiny_state(1)
    save_safetensors(good, tmp_path / "w.safetensors")
    m.load_state_dict({k: t.numpy() for k, t in open_safetensors(tmp_path / "w.safetensors").items()})
    for k, v in m.state_dict().items():
        np.testing.assert_array_equal(v, good[k])
    ids = np.array([[1, 2, 3]])
    with no_grad():
        np.testing.assert_array_equal(m(ids), CausalLM.from_hf(good, TINY)(ids))
