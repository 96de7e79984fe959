"""``npattn.data``: the arrays shipped in the package (what the notebooks read outside the repository)."""

import numpy as np
import pytest

from npattn import data


def test_names_lists_every_shipped_file():
    assert data.names() == ["chapter3", "chapter4", "torch_mha_reference"]


def test_load_reads_the_arrays_into_memory():
    book = data.load("chapter3")
    assert book["inputs"].dtype == np.float32 and book["inputs"].shape == (6, 3)
    # the book's printed first input row, "Your"
    np.testing.assert_allclose(book["inputs"][0], [0.43, 0.15, 0.89], atol=1e-6)
    ref = data.load("torch_mha_reference")
    assert ref["x"].dtype == np.float64 and any(k.startswith("ref.") for k in ref)


def test_load_refuses_an_unknown_name():
    with pytest.raises(ValueError, match=r"name must be one of \['chapter3'.*got 'chapter5'"):
        data.load("chapter5")


def test_load_refuses_a_non_string():
    with pytest.raises(TypeError, match="name must be a str, got int"):
        data.load(3)
