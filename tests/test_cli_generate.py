"""``npattn generate DIR PROMPT``: a tiny checkpoint written with numpy and a tiny word-level
tokenizer trained here (nothing downloaded); the streamed completion is the greedy one."""

from __future__ import annotations

import json

import numpy as np
import pytest

from npattn.__main__ import main
from npattn.generation import generate
from npattn.models import CausalLM
from npattn.models.hf import save_safetensors

WORDS = "the cat sat on a mat and the dog ate my hat while a bird sang".split()


def _checkpoint(path, vocab_size, eos=None):
    config = {
        "model_type": "qwen3",
        "vocab_size": vocab_size,
        "hidden_size": 16,
        "intermediate_size": 24,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 4,
        "tie_word_embeddings": True,
        "eos_token_id": eos,
    }
    m = CausalLM(config, rng=0, dtype=np.float32)
    for p in m.parameters():
        p.data[...] = p.data * 4  # a peaked distribution: greedy is stable
    save_safetensors(m.state_dict(), path / "model.safetensors")
    (path / "config.json").write_text(json.dumps(config))
    return m


def _tokenizer(path):
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    trainer = tokenizers.trainers.WordLevelTrainer(special_tokens=["[UNK]"])
    tok.train_from_iterator([" ".join(WORDS)] * 3, trainer)
    tok.save(str(path / "tokenizer.json"))
    return tok


def test_generate_streams_the_greedy_completion(tmp_path, capsys):
    tok = _tokenizer(tmp_path)
    m = _checkpoint(tmp_path, tok.get_vocab_size())
    prompt = "the cat sat on"
    ids = tok.encode(prompt).ids
    expect = generate(m, np.array([ids]), 6, 64)[0, len(ids) :].tolist()
    assert main(["generate", str(tmp_path), prompt, "--max-new-tokens", "6"]) == 0
    out = capsys.readouterr().out
    first, last = out.rstrip("\n").rsplit("\n", 1)
    assert first == tok.decode(ids + expect)  # the prompt, then the words after it (a space between)
    assert first.startswith(prompt + " ")
    assert last.startswith("[6 tokens in ") and last.endswith(" tokens/s]")
    # the prompt's words as separate arguments (not quoted in a shell): the same prompt
    assert main(["generate", str(tmp_path), *prompt.split(), "--max-new-tokens", "6"]) == 0
    assert capsys.readouterr().out.rstrip("\n").rsplit("\n", 1)[0] == tok.decode(ids + expect)


def test_generate_sampling_is_seeded_and_stops_at_eos(tmp_path, capsys):
    tok = _tokenizer(tmp_path)
    m = _checkpoint(tmp_path, tok.get_vocab_size())
    args = ["generate", str(tmp_path), "a bird", "--max-new-tokens", "8", "--temperature", "1.5"]
    args += ["--top-k", "5", "--top-p", "0.9", "--seed", "7"]
    assert main(args) == 0
    a = capsys.readouterr().out
    assert main(args) == 0
    assert capsys.readouterr().out.split("\n")[0] == a.split("\n")[0]
    # eos: the greedy first token, so generation stops after one token
    ids = tok.encode("a bird").ids
    first = int(generate(m, np.array([ids]), 1, 64)[0, -1])
    _checkpoint(tmp_path, tok.get_vocab_size(), eos=[first])
    assert main(["generate", str(tmp_path), "a bird"]) == 0
    assert "[1 tokens in" in capsys.readouterr().out


def test_generate_errors(tmp_path, capsys):
    pytest.importorskip("tokenizers")  # without it the first error is the missing package (next test)
    assert main(["generate", str(tmp_path), "x"]) == 2
    assert "tokenizer.json" in capsys.readouterr().err
    _tokenizer(tmp_path)
    assert main(["generate", str(tmp_path), "the"]) == 2
    assert "config.json" in capsys.readouterr().err
    _checkpoint(tmp_path, 40)
    assert main(["generate", str(tmp_path), "the", "--top-p", "1.5"]) == 2
    assert "top_p" in capsys.readouterr().err
    assert main(["generate", str(tmp_path), "the", "--min-p", "1.5"]) == 2
    assert "min_p: expected a number in [0, 1]" in capsys.readouterr().err
    assert main(["generate", str(tmp_path), "the", "--repetition-penalty", "0"]) == 2
    assert "repetition_penalty: expected a finite number > 0" in capsys.readouterr().err
    assert main(["generate", str(tmp_path), "", "--max-new-tokens", "2"]) == 2
    assert "no tokens" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", str(tmp_path)])


def test_generate_without_tokenizers(tmp_path, capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import fails as if not installed
    assert main(["generate", str(tmp_path), "x"]) == 2
    err = capsys.readouterr().err
    assert "tokenizers" in err and err.count("\n") == 1
    assert 'pip install "npattn[hf]"' in err and 'pip install ".[hf]"' in err
    assert main(["generate", str(tmp_path), "x", "--chat"]) == 2  # --chat refuses --ids: not offered
    err = capsys.readouterr().err
    assert "tokenizers" in err and err.count("\n") == 1 and "--ids" not in err


def _bad_config(key, value):
    def damage(path):
        config = json.loads((path / "config.json").read_text())
        config[key] = value
        (path / "config.json").write_text(json.dumps(config))

    return damage


def _write(name, data):
    def damage(path):
        (path / name).write_bytes(data)

    return damage


# (damage done to a working directory, the argument, then a word the one-line message must hold)
BROKEN = {
    "missing directory": (None, "missing", "no such directory"),
    "config.json not JSON": (_write("config.json", b"{not json"), None, "config.json"),
    "config.json a list": (_write("config.json", b"[1, 2]"), None, "config"),
    "no config.json": (lambda p: (p / "config.json").unlink(), None, "config.json"),
    "safetensors truncated": (_write("model.safetensors", b"\x10\x00\x00"), None, "model.safetensors"),
    "safetensors malformed header": (
        _write("model.safetensors", b"\x10\x00\x00\x00\x00\x00\x00\x00" + b'{"a": 1}'.ljust(16)),
        None,
        "model.safetensors",
    ),
    "no safetensors": (lambda p: (p / "model.safetensors").unlink(), None, "safetensors"),
    "no tokenizer.json": (lambda p: (p / "tokenizer.json").unlink(), None, "tokenizer.json"),
    "tokenizer.json without a model": (_write("tokenizer.json", b"{}"), None, "tokenizer.json"),
    "tokenizer.json not UTF-8": (_write("tokenizer.json", b"\xff\xfe\x00"), None, "tokenizer.json"),
    "eos_token_id a string": (_bad_config("eos_token_id", "x"), None, "eos_token_id"),
    "eos_token_id a float": (_bad_config("eos_token_id", 1.5), None, "eos_token_id"),
    "eos_token_id a bool": (_bad_config("eos_token_id", True), None, "eos_token_id"),
    "eos_token_id negative": (_bad_config("eos_token_id", -1), None, "eos_token_id"),
    "eos_token_id past the vocabulary": (_bad_config("eos_token_id", 10**6), None, "eos_token_id"),
    "eos_token_id list with null": (_bad_config("eos_token_id", [1, None]), None, "eos_token_id"),
    "prompt past the model's vocabulary": (None, None, "vocab_size"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_generate_errors_are_one_line_exit_2(tmp_path, capsys, case):
    """Every loading, config, tokenizer or input error: one line on stderr naming what is wrong,
    exit status 2, no traceback, and nothing on stdout (the prompt is not printed first)."""
    damage, directory, word = BROKEN[case]
    tok = _tokenizer(tmp_path)
    vocab = 5 if case.startswith("prompt") else tok.get_vocab_size()  # "bird sang" has ids >= 5
    _checkpoint(tmp_path, vocab)
    if damage is not None:
        damage(tmp_path)
    target = str(tmp_path / directory) if directory else str(tmp_path)
    assert main(["generate", target, "bird sang", "--max-new-tokens", "2"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("npattn generate: ") and err.endswith("\n") and err.count("\n") == 1
    assert word in err and "Traceback" not in err


def test_generate_error_in_a_process(tmp_path):
    """The command as a user runs it: a bad eos_token_id is one line on stderr, exit status 2."""
    import subprocess
    import sys

    tok = _tokenizer(tmp_path)
    _checkpoint(tmp_path, tok.get_vocab_size())
    _bad_config("eos_token_id", "</s>")(tmp_path)
    run = subprocess.run(
        [sys.executable, "-m", "npattn", "generate", str(tmp_path), "the cat"], capture_output=True, text=True
    )
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.count("\n") == 1 and "eos_token_id" in run.stderr and "Traceback" not in run.stderr


def test_generate_from_save_pretrained_matches_transformers(tmp_path, capsys):
    """A transformers save_pretrained directory (Gemma 3: sliding windows, softcapping, sandwich
    norms) with a byte-level BPE tokenizer: npattn's greedy completion is transformers' own."""
    torch = pytest.importorskip("torch")
    T = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<eos>"]
    )
    tok.train_from_iterator([" ".join(WORDS)] * 20, trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    cfg = T.Gemma3TextConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
        final_logit_softcapping=30.0,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=0,
        tie_word_embeddings=False,  # a random tied model mostly repeats its last token
    )
    torch.manual_seed(0)
    hf = T.Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p))
    hf.save_pretrained(tmp_path)
    prompt = "the dog ate"
    ids = tok.encode(prompt).ids
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=8, min_new_tokens=8, do_sample=False)[0, len(ids) :]
    assert main(["generate", str(tmp_path), prompt, "--max-new-tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert len(set(ref.tolist())) > 2  # a completion worth comparing, not one token repeated
    assert out.split("\n")[0] == prompt + tok.decode(ref.tolist())


def test_stream_holds_back_half_characters(tmp_path, capsys, monkeypatch):
    """A byte-level tokenizer may split a character over two tokens: the stream prints it once
    it is whole, never a replacement character in between."""
    import npattn.tools.generate as gen

    tok = _tokenizer(tmp_path)
    _checkpoint(tmp_path, tok.get_vocab_size())
    pieces = {1: "caf", 2: "caf\ufffd", 3: "café", 4: "café!"}

    class FakeTokenizer:
        @staticmethod
        def from_file(path):
            return FakeTokenizer()

        def encode(self, text):
            return type("E", (), {"ids": [1, 2]})()

        def decode(self, ids):
            return pieces[min(len(ids), 4)]

    monkeypatch.setattr("tokenizers.Tokenizer", FakeTokenizer)
    monkeypatch.setattr(gen, "stream", lambda model, prompt, n, **kw: iter([5, 6, 7, 8][:n]))
    assert main(["generate", str(tmp_path), ">", "--max-new-tokens", "4"]) == 0
    first = capsys.readouterr().out.split("\n")[0]
    assert first == ">café!" and "\ufffd" not in first
    monkeypatch.setattr(gen, "stream", lambda model, prompt, n, **kw: iter([5, 6][:n]))
    assert main(["generate", str(tmp_path), ">", "--max-new-tokens", "2"]) == 0
    assert capsys.readouterr().out.split("\n")[0] == ">caf\ufffd"  # still incomplete at the end: printed as decoded


# -- --chat, --ids, a missing tokenizer ----------------------------------------------------------
CHAT = """{{ bos_token }}
{% for message in messages %}
    {% if message['role'] not in ['user', 'assistant'] %}
        {{ raise_exception('roles: user and assistant only') }}
    {% endif %}
    <|{{ message['role'] }}|> {{ message['content'] | trim }} {{ eos_token }}
    {% if loop.last %}{% break %}{% endif %}
{% endfor %}
{% if add_generation_prompt %}<|assistant|>{% endif %}"""


def _chat_dir(path, template=CHAT, jinja=None, **config):
    """A tokenizer with chat tokens, tokenizer_config.json with ``template`` (None: none) and
    the special tokens (eos as an added-token object, as transformers writes them), optionally
    chat_template.jinja; a checkpoint of its vocabulary."""
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    special = ["[UNK]", "<s>", "</s>", "<|user|>", "<|assistant|>"]
    tok.train_from_iterator([" ".join(WORDS)] * 3, tokenizers.trainers.WordLevelTrainer(special_tokens=special))
    tok.add_special_tokens(special)
    tok.save(str(path / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "unk_token": "[UNK]"}
    cfg["eos_token"] = {
        "content": "</s>",
        "lstrip": False,
        "normalized": False,
        "special": True,
        "__type": "AddedToken",
    }
    if template is not None:
        cfg["chat_template"] = template
    cfg.update(config)
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    if jinja is not None:
        (path / "chat_template.jinja").write_text(jinja)
    return tok, _checkpoint(path, tok.get_vocab_size())


def _prompt_ids(monkeypatch, args):
    """The prompt ids ``npattn generate`` decodes from (its stream replaced by one that records them)."""
    import npattn.tools.generate as gen

    seen = []
    monkeypatch.setattr(gen, "stream", lambda model, prompt, n, **kw: seen.append(list(prompt)) or iter(()))
    assert main(["generate", *args]) == 0
    return seen[0]


TEMPLATES = {
    "config": dict(),
    "named templates": dict(template=[{"name": "tool_use", "template": "x"}, {"name": "default", "template": CHAT}]),
    "chat_template.jinja first": dict(
        template="{{ raise_exception('not this one') }}", jinja=CHAT.replace("|>", "|> ")
    ),
    "tojson and a loop": dict(
        template="{% for m in messages %}{{ m | tojson }}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    ),
}


@pytest.mark.parametrize("case", sorted(TEMPLATES))
def test_chat_renders_the_template_as_transformers(tmp_path, monkeypatch, capsys, case):
    """--chat: the ids are transformers' apply_chat_template(add_generation_prompt=True) of the
    prompt as a user message, from the same directory (tokenizer_config.json's template, a list
    of named ones, chat_template.jinja before it)."""
    T = pytest.importorskip("transformers")
    pytest.importorskip("jinja2")
    _chat_dir(tmp_path, **TEMPLATES[case])
    prompt = "  the cat sat on  "
    ids = _prompt_ids(monkeypatch, [str(tmp_path), prompt, "--chat"])
    hf = T.AutoTokenizer.from_pretrained(tmp_path)
    ref = hf.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True)
    assert ids == list(ref["input_ids"] if hasattr(ref, "keys") else ref)
    assert len(ids) > 3


def test_chat_prints_the_reply(tmp_path, capsys):
    pytest.importorskip("jinja2")
    import npattn.tools.generate as gen

    tok, m = _chat_dir(tmp_path)
    ids = tok.encode(
        gen._chat_text(str(tmp_path), [{"role": "user", "content": "a bird"}]), add_special_tokens=False
    ).ids
    assert ids[0] == tok.token_to_id("<s>") and ids[-1] == tok.token_to_id("<|assistant|>")
    expect = m.generate(np.array([ids]), 5)[0, len(ids) :].tolist()
    assert main(["generate", str(tmp_path), "a bird", "--chat", "--max-new-tokens", "5"]) == 0
    out = capsys.readouterr().out
    assert out.split("\n")[0] == tok.decode(expect)  # the reply alone, not the prompt


CHAT_ERRORS = {
    "no template": (dict(template=None), "no chat template"),
    "raise_exception": (dict(template="{{ raise_exception('roles: user only, please') }}"), "roles: user only, please"),
    "sandboxed": (dict(template="{{ ''.__class__.__mro__[1].__subclasses__() }}"), "SecurityError"),
    "syntax": (dict(template="{% for m in messages %}"), "chat template failed"),
    "named templates without a default": (dict(template=[{"name": "tool_use", "template": "x"}]), "no chat template"),
    "tokenizer_config.json not JSON": (dict(), "tokenizer_config.json"),
}


@pytest.mark.parametrize("case", sorted(CHAT_ERRORS))
def test_chat_errors_are_one_line_exit_2(tmp_path, capsys, case):
    pytest.importorskip("jinja2")
    changes, word = CHAT_ERRORS[case]
    _chat_dir(tmp_path, **changes)
    if case == "tokenizer_config.json not JSON":
        (tmp_path / "tokenizer_config.json").write_text("{not json")
    assert main(["generate", str(tmp_path), "the cat", "--chat"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("npattn generate: ") and err.count("\n") == 1
    assert word in err and "Traceback" not in err


def test_chat_without_jinja2_and_with_ids(tmp_path, capsys, monkeypatch):
    import sys

    _chat_dir(tmp_path)
    assert main(["generate", str(tmp_path), "1 2", "--chat", "--ids"]) == 2
    assert "--ids" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "jinja2", None)  # import fails as if not installed
    assert main(["generate", str(tmp_path), "the cat", "--chat"]) == 2
    err = capsys.readouterr().err
    assert "jinja2" in err and 'pip install "npattn[hf]"' in err and err.count("\n") == 1


def test_ids_need_no_tokenizer(tmp_path, capsys, monkeypatch):
    """--ids: token ids in, token ids out, with neither tokenizer.json nor the tokenizers package."""
    import sys

    m = _checkpoint(tmp_path, 40)
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    expect = m.generate(np.array([[3, 1, 4, 1, 5]]), 6)[0].tolist()
    for prompt in ("3 1 4 1 5", "3,1,4,1,5", " 3, 1 4,1  5 ", ["3", "1", "4", "1", "5"], ["3,", "1", "4,1", "5"]):
        words = [prompt] if isinstance(prompt, str) else prompt  # one argument, or several (unquoted)
        assert main(["generate", str(tmp_path), *words, "--ids", "--max-new-tokens", "6"]) == 0
        first, last = capsys.readouterr().out.rstrip("\n").split("\n")
        assert first == " ".join(map(str, expect)) and last.startswith("[6 tokens in ")


@pytest.mark.parametrize(
    "prompt,word", [("1 x 2", "'x'"), ("", "nothing"), (" , ", "nothing"), ("1 -2", "'-2'"), ("1 40", "vocab_size")]
)
def test_bad_ids_are_one_line_exit_2(tmp_path, capsys, prompt, word):
    _checkpoint(tmp_path, 40)
    assert main(["generate", str(tmp_path), prompt, "--ids"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and word in err and "PROMPT" in err


def test_missing_tokenizer_says_what_to_do(tmp_path, capsys):
    pytest.importorskip("tokenizers")
    _checkpoint(tmp_path, 40)
    assert main(["generate", str(tmp_path), "the cat"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no tokenizer.json" in err and "--ids" in err and "copy" in err
    # --chat refuses --ids: the error does not offer it
    assert main(["generate", str(tmp_path), "the cat", "--chat"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no tokenizer.json" in err and "copy" in err and "--ids" not in err


def test_bfloat16_keeps_the_weights_as_bfloat16(tmp_path, capsys, monkeypatch):
    """--bfloat16: the model loaded with weights_dtype='bfloat16', its tokens printed."""
    from npattn.models import CausalLM

    _checkpoint(tmp_path, 40)
    small = CausalLM.from_pretrained(tmp_path, weights_dtype="bfloat16")
    expect = small.generate(np.array([[3, 1, 4, 1, 5]]), 6)[0].tolist()
    loaded = []
    real = CausalLM.from_pretrained.__func__
    monkeypatch.setattr(
        CausalLM, "from_pretrained", classmethod(lambda cls, *a, **k: loaded.append(real(cls, *a, **k)) or loaded[-1])
    )
    assert main(["generate", str(tmp_path), "3 1 4 1 5", "--ids", "--bfloat16", "--max-new-tokens", "6"]) == 0
    assert capsys.readouterr().out.split("\n")[0] == " ".join(map(str, expect))
    assert [m.weights_dtype for m in loaded] == ["bfloat16"]
    assert main(["generate", str(tmp_path), "3 1 4 1 5", "--ids", "--max-new-tokens", "6"]) == 0
    assert [m.weights_dtype for m in loaded] == ["bfloat16", None]
