"""``generation_config.json``: transformers' ``from_pretrained`` makes it the model's
``generation_config``, whose ``eos_token_id`` (an id or a list) and ``pad_token_id`` its
``generate`` uses instead of ``config.json``'s — and with the file present, a key it leaves out is
None, not config.json's.  npattn's ``from_pretrained`` reads it (strict JSON, its keys checked),
``generate``, ``stream`` and ``npattn generate`` use it, ``save_pretrained`` writes it back."""

from __future__ import annotations

import json

import numpy as np
import pytest

from npattn.__main__ import main
from npattn.models import CausalLM
from npattn.models.tiny import tiny_config

IDS = np.array([[1, 5, 9, 2, 30, 7], [3, 3, 8, 36, 11, 4]])


def _saved(tmp_path, generation_config, eos=None):
    """A tiny Qwen3 saved by transformers (float64, peaked weights) with ``config.json``'s
    ``eos_token_id`` ``eos`` and the given ``generation_config.json`` (None: none)."""
    torch = pytest.importorskip("torch")
    T = pytest.importorskip("transformers")
    from _hf64 import randomize

    config = T.AutoConfig.for_model(**tiny_config("qwen3", eos_token_id=eos, pad_token_id=None))
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = T.AutoModelForCausalLM.from_config(config).double().eval()
    randomize(hf, 0, scale=0.5)
    hf.save_pretrained(tmp_path)
    path = tmp_path / "generation_config.json"
    path.unlink(missing_ok=True)
    if generation_config is not None:
        path.write_text(json.dumps(generation_config))
    return tmp_path


def _transformers_generate(directory, n):
    import torch

    T = pytest.importorskip("transformers")
    from _hf64 import float64_reference

    hf = T.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float64, attn_implementation="eager").eval()
    with torch.no_grad(), float64_reference():
        ids = torch.from_numpy(IDS)
        return hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False).numpy()


def _free(tmp_path):
    """The greedy completion without any eos."""
    m = CausalLM.from_pretrained(_saved(tmp_path / "free", None))
    return m.generate(IDS, 10, eos_token_id=[])


def test_generation_config_eos_and_pad_take_precedence_as_in_transformers(tmp_path):
    free = _free(tmp_path)
    # row 0's third new token ends it; config.json's eos, row 1's first new token, must not
    stop, ignored = int(free[0, 8]), int(free[1, 6])
    assert stop not in free[0, 6:8].tolist() and ignored not in free[0, 6:8].tolist()
    pad = next(t for t in range(40) if t not in (stop, ignored))
    d = _saved(tmp_path / "d", {"eos_token_id": [stop, 39], "pad_token_id": pad}, eos=ignored)
    m = CausalLM.from_pretrained(d, dtype=np.float64)
    assert m.generation_config == {"eos_token_id": [stop, 39], "pad_token_id": pad}
    assert m.generation_defaults == {"eos_token_id": [stop, 39], "pad_token_id": pad, "repetition_penalty": None}
    assert m.config.eos_token_id == ignored  # config.json's, kept as it is
    out = m.generate(IDS, 10)
    ref = _transformers_generate(d, 10)
    np.testing.assert_array_equal(out[:, : ref.shape[1]], ref)
    assert out[0, 6:9].tolist() == free[0, 6:9].tolist() and set(out[0, 9:].tolist()) == {pad}
    assert out[1, 6] == ignored and out[1, 7] != pad  # config.json's eos does not end row 1
    streamed = np.stack(list(m.stream(IDS, 10)), axis=1)  # until every row has finished
    np.testing.assert_array_equal(streamed, out[:, 6 : 6 + streamed.shape[1]])


def test_a_key_the_file_leaves_out_is_none_as_in_transformers(tmp_path):
    """generation_config.json without eos_token_id: no eos at all, although config.json has one;
    without the file, config.json's eos ends the row (and the pad is that eos)."""
    free = _free(tmp_path)
    eos = int(free[0, 7])
    d = _saved(tmp_path / "d", {"pad_token_id": 0}, eos=eos)
    m = CausalLM.from_pretrained(d, dtype=np.float64)
    assert m.generation_defaults == {"eos_token_id": None, "pad_token_id": 0, "repetition_penalty": None}
    out = m.generate(IDS, 10)
    np.testing.assert_array_equal(out, free)
    np.testing.assert_array_equal(out, _transformers_generate(d, 10))
    d = _saved(tmp_path / "e", None, eos=eos)
    m = CausalLM.from_pretrained(d, dtype=np.float64)
    assert m.generation_config is None and m.generation_defaults["eos_token_id"] == eos
    out = m.generate(IDS, 10)
    ref = _transformers_generate(d, 10)
    np.testing.assert_array_equal(out[:, : ref.shape[1]], ref)
    assert set(out[0, 8:].tolist()) == {eos}


def test_its_repetition_penalty_applies_to_greedy_decoding_as_in_transformers(tmp_path, capsys):
    """transformers applies generation_config.json's repetition_penalty in greedy decoding too
    (Qwen2.5's instruct models ship 1.05): generate, stream and npattn generate take it; an
    argument overrides it (1.0: none); config.json's never counts."""
    free = _free(tmp_path)
    d = _saved(tmp_path / "d", {"repetition_penalty": 2.0})  # no eos anywhere
    m = CausalLM.from_pretrained(d, dtype=np.float64)
    assert m.generation_defaults["repetition_penalty"] == 2.0
    out = m.generate(IDS, 10)
    np.testing.assert_array_equal(out, _transformers_generate(d, 10))
    assert not np.array_equal(out, free)
    np.testing.assert_array_equal(m.generate(IDS, 10, repetition_penalty=1.0), free)
    np.testing.assert_array_equal(np.stack(list(m.stream(IDS, 10)), axis=1), out[:, 6:])
    assert main(["generate", str(d), " ".join(map(str, IDS[0])), "--ids", "--max-new-tokens", "10"]) == 0
    assert capsys.readouterr().out.split("\n")[0].split()[6:] == [str(t) for t in out[0, 6:]]
    args = ["generate", str(d), " ".join(map(str, IDS[0])), "--ids", "--max-new-tokens", "10"]
    assert main(args + ["--repetition-penalty", "1"]) == 0
    assert capsys.readouterr().out.split("\n")[0].split()[6:] == [str(t) for t in free[0, 6:]]


def test_save_pretrained_writes_it_back_and_the_cli_stops_at_its_eos(tmp_path, capsys):
    free = _free(tmp_path)
    stop = int(free[0, 8])
    d = _saved(tmp_path / "d", {"eos_token_id": stop, "do_sample": True, "top_k": 20})
    m = CausalLM.from_pretrained(d, dtype=np.float64)
    m.save_pretrained(tmp_path / "copy")
    again = CausalLM.from_pretrained(tmp_path / "copy")
    assert again.generation_config == {"eos_token_id": stop, "do_sample": True, "top_k": 20}
    assert main(["generate", str(tmp_path / "copy"), " ".join(map(str, IDS[0])), "--ids"]) == 0
    out = capsys.readouterr().out
    assert out.split("\n")[0].split()[6:] == [str(t) for t in free[0, 6:9]]
    assert "[3 tokens in" in out


@pytest.mark.parametrize(
    "text, message",
    [
        ('{"eos_token_id": "5"}', r"generation_config.json: eos_token_id: expected a token id .* got '5'"),
        ('{"eos_token_id": [1, -1]}', r"eos_token_id: expected a token id \(an integer >= 0\), a list of them"),
        ('{"eos_token_id": [1, 2.0]}', r"eos_token_id: expected a token id"),
        ('{"pad_token_id": true}', r"pad_token_id: expected a token id \(an integer >= 0\) or null, got True"),
        ('{"pad_token_id": [1]}', r"pad_token_id: expected a token id"),
        ('{"repetition_penalty": 0}', r"repetition_penalty: expected a number > 0 or null, got 0"),
        ('{"repetition_penalty": "1.1"}', r"repetition_penalty: expected a number > 0 or null, got '1.1'"),
        ('{"repetition_penalty": true}', r"repetition_penalty: expected a number > 0 or null, got True"),
        ('{"eos_token_id": 1, "eos_token_id": 2}', r"generation_config.json has a duplicate key 'eos_token_id'"),
        ('{"eos_token_id": NaN}', r"generation_config.json has NaN, which is not JSON"),
        ("[1, 2]", r"generation_config.json: expected a JSON object \(the generation config\), got list"),
        ('{"eos_token_id": 1', r"generation_config.json is not valid JSON"),
    ],
)
def test_a_malformed_generation_config_is_refused_by_name(tmp_path, text, message):
    CausalLM(tiny_config("qwen3"), rng=0).save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(text)
    with pytest.raises(ValueError, match=message):
        CausalLM.from_pretrained(tmp_path)
    assert main(["generate", str(tmp_path), "1 2", "--ids"]) == 2
