"""``npattn.models.chat``: a checkpoint's chat template rendered as transformers'
``apply_chat_template(..., tokenize=False)`` renders it (multi-turn conversations, a system
message, tools, a template's own variables such as Qwen3's ``enable_thinking``), and its tokenizer
(``tokenizer.json``, or a GGUF file's) as a ``tokenizers.Tokenizer``; bad input refused by name."""

from __future__ import annotations

import json
import sys

import pytest

from npattn.models.chat import apply_chat_template, load_tokenizer, read_chat_template

# ChatML as Qwen3 lays it out: a system message first, tools in the system turn, a template
# variable (enable_thinking) that changes the generation prompt
CHATML = """{%- if tools %}<|im_start|>system
{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}

{% endif %}# Tools
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}<|im_end|>
{% elif messages[0]['role'] == 'system' %}<|im_start|>system
{{ messages[0]['content'] }}<|im_end|>
{% endif %}
{%- for message in messages %}
    {%- if message['role'] != 'system' %}
        {%- if message['role'] not in ['user', 'assistant'] %}{{ raise_exception('roles: user, assistant') }}{% endif %}
<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}
{%- endif %}"""

CONVERSATION = [
    {"role": "system", "content": "You are terse. <b>&</b> é"},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "  And 3 + 3?  "},
]
TOOLS = [{"type": "function", "function": {"name": "add", "description": "a + b <= c & d", "parameters": {"a": "int"}}}]


def _directory(path, template=CHATML, jinja=None, tokenizer=True):
    """tokenizer_config.json with ``template`` (None: none) and its special tokens, optionally
    chat_template.jinja, and (with the tokenizers package) a word-level tokenizer.json."""
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>"}
    cfg["pad_token"] = {"content": "<|endoftext|>", "special": True, "__type": "AddedToken"}
    if template is not None:
        cfg["chat_template"] = template
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    if jinja is not None:
        (path / "chat_template.jinja").write_text(jinja)
    if tokenizer:
        tk = pytest.importorskip("tokenizers")
        tok = tk.Tokenizer(tk.models.WordLevel(unk_token="[UNK]"))
        tok.pre_tokenizer = tk.pre_tokenizers.Whitespace()
        special = ["[UNK]", "<|im_start|>", "<|im_end|>", "<|endoftext|>"]
        words = "What is 2 + 3 ? And You are terse . system user assistant think # Tools"
        tok.train_from_iterator([words] * 3, tk.trainers.WordLevelTrainer(special_tokens=special))
        tok.add_special_tokens(special)
        tok.save(str(path / "tokenizer.json"))
    return path


CASES = {
    "one user message, generation prompt": dict(conversation=CONVERSATION[1:2], add_generation_prompt=True),
    "multi-turn with a system message": dict(conversation=CONVERSATION, add_generation_prompt=True),
    "no generation prompt": dict(conversation=CONVERSATION),
    "tools": dict(conversation=CONVERSATION, tools=TOOLS, add_generation_prompt=True),
    "enable_thinking=False": dict(conversation=CONVERSATION[1:2], add_generation_prompt=True, enable_thinking=False),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_rendered_as_transformers_renders_it(tmp_path, case):
    T = pytest.importorskip("transformers")
    pytest.importorskip("jinja2")
    kw = dict(CASES[case])
    conversation = kw.pop("conversation")
    _directory(tmp_path)
    text = apply_chat_template(tmp_path, conversation, **kw)
    ref = T.AutoTokenizer.from_pretrained(tmp_path).apply_chat_template(conversation, tokenize=False, **kw)
    assert text == ref
    assert ("<think>" in text) == (case == "enable_thinking=False")


def test_rendered_text_without_transformers(tmp_path):
    """The template's own text, written out by hand: the system turn, the turns in order, the
    generation prompt; the special tokens of tokenizer_config.json are variables; tojson leaves
    HTML characters and non-ASCII text as they are (transformers' filter, not jinja's)."""
    pytest.importorskip("jinja2")
    _directory(tmp_path, tokenizer=False)
    text = apply_chat_template(tmp_path, CONVERSATION[:2], tools=TOOLS, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are terse. <b>&</b> é\n\n# Tools\n"
        + json.dumps(TOOLS[0], ensure_ascii=False)
        + "\n<|im_end|>\n<|im_start|>user\nWhat is 2 + 2?<|im_end|><|im_start|>assistant\n"
    )  # the template's "{%-" tags strip the whitespace before them
    _directory(tmp_path, template="{{ eos_token }}|{{ pad_token }}|{{ bos_token }}|{{ greeting }}", tokenizer=False)
    assert apply_chat_template(tmp_path, [], greeting="hi") == "<|im_end|>|<|endoftext|>||hi"
    template, special, where = read_chat_template(tmp_path)
    assert special == {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"} and where.endswith(
        "tokenizer_config.json"
    )


def test_chat_template_jinja_and_named_templates(tmp_path):
    """chat_template.jinja before tokenizer_config.json's (transformers 5 saves it so); a list of
    named templates gives its "default"."""
    pytest.importorskip("jinja2")
    _directory(tmp_path, template="config", jinja="jinja {{ messages | length }}", tokenizer=False)
    assert apply_chat_template(tmp_path, CONVERSATION) == "jinja 4"
    assert read_chat_template(tmp_path)[2].endswith("chat_template.jinja")
    named = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "default"}]
    _directory(tmp_path / "..", template=named, tokenizer=False)
    assert apply_chat_template(tmp_path / "..", CONVERSATION) == "default"


@pytest.mark.parametrize(
    "template, error, message",
    [
        (None, ValueError, "no chat template in .*: the model may not be a chat model"),
        ([{"name": "tool_use", "template": "x"}], ValueError, "no chat template"),
        (
            "{{ raise_exception('roles: user only') }}",
            ValueError,
            r"tokenizer_config.json: the chat template failed .*user only",
        ),
        ("{{ ''.__class__.__mro__[1].__subclasses__() }}", ValueError, "SecurityError"),
        ("{% for m in messages %}", ValueError, "TemplateSyntaxError"),
    ],
)
def test_template_errors_are_value_errors_naming_the_file(tmp_path, template, error, message):
    pytest.importorskip("jinja2")
    _directory(tmp_path, template=template, tokenizer=False)
    with pytest.raises(error, match=message):
        apply_chat_template(tmp_path, CONVERSATION[1:2])


@pytest.mark.parametrize(
    "conversation, message",
    [
        ("hello", "conversation: expected a list of messages"),
        ({"role": "user", "content": "x"}, "conversation: expected a list of messages"),
        ([{"content": "x"}], r"conversation\[0\]: expected a mapping with a 'role' string"),
        ([{"role": "user", "content": "x"}, ("user", "y")], r"conversation\[1\]"),
        (None, "conversation: expected a list"),
    ],
)
def test_bad_conversations_are_refused_by_name(tmp_path, conversation, message):
    _directory(tmp_path, tokenizer=False)
    with pytest.raises(TypeError, match=message):
        apply_chat_template(tmp_path, conversation)


def test_bad_paths_files_and_missing_packages(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"path: expected a checkpoint directory or a GGUF file, got .*nowhere"):
        apply_chat_template(tmp_path / "nowhere", [])
    with pytest.raises(ValueError, match="path: expected a checkpoint directory or a GGUF file"):
        load_tokenizer(tmp_path / "nowhere")
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"cannot read .*tokenizer_config.json"):
        read_chat_template(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("[1]")
    with pytest.raises(ValueError, match="expected a JSON object, got list"):
        read_chat_template(tmp_path)
    monkeypatch.setitem(sys.modules, "jinja2", None)  # import fails as if not installed
    with pytest.raises(ImportError, match=r'jinja2 package \(pip install "npattn\[hf\]"'):
        apply_chat_template(tmp_path, [])
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(ImportError, match=r'tokenizers package \(pip install "npattn\[hf\]"'):
        load_tokenizer(tmp_path)


def test_load_tokenizer_reads_the_directorys_tokenizer(tmp_path):
    tk = pytest.importorskip("tokenizers")
    with pytest.raises(FileNotFoundError, match="no tokenizer.json in .*: copy the model's tokenizer.json there"):
        load_tokenizer(tmp_path)
    _directory(tmp_path)
    tok = load_tokenizer(tmp_path)
    ref = tk.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    text = "<|im_start|>user What is 2 + 3 ?<|im_end|>"
    assert tok.encode(text).ids == ref.encode(text).ids and len(tok.encode(text).ids) == 9
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0"}')
    with pytest.raises(ValueError, match="tokenizer.json: not a readable tokenizer"):
        load_tokenizer(tmp_path)


def test_load_tokenizer_and_template_of_a_gguf_file(tmp_path):
    """A GGUF file: its tokenizer rebuilt from the metadata (gguf_tokenizer's), its
    tokenizer.chat_template with its bos and eos tokens as variables."""
    gguf = pytest.importorskip("gguf")
    pytest.importorskip("tokenizers")
    pytest.importorskip("jinja2")
    from npattn.models.gguf import gguf_tokenizer

    tokens = ["<s>", "</s>", "a", "b", "ab"]
    w = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 1, 1, 1])
    w.add_token_merges(["a b"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    w.add_chat_template("{{ bos_token }}{% for m in messages %}{{ m['content'] }}{{ eos_token }}{% endfor %}")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    path = tmp_path / "t.gguf"
    assert load_tokenizer(path).encode("ab").ids == gguf_tokenizer(path).encode("ab").ids == [4]
    assert apply_chat_template(path, [{"role": "user", "content": "ab"}]) == "<s>ab</s>"
