"""``npattn chat DIRECTORY``: a conversation on standard input and output.  Each turn's prompt is
the whole conversation so far in the chat template (the replies kept as assistant messages), its
reply the model's greedy tokens for that prompt; ``/reset``, ``/exit`` and the end of input;
``--system``; errors before the first prompt are one line and exit status 2, a turn's error is
reported and the conversation goes on without that message."""

from __future__ import annotations

import functools
import io
import sys

import numpy as np
import pytest
from test_cli_generate import _chat_dir

from npattn.__main__ import main
from npattn.models import CausalLM, apply_chat_template

pytest.importorskip("jinja2")

# every role, and a refusal of one message's content (a turn's error)
ANY_ROLE = """{{ bos_token }}{% for m in messages %}
{% if m['content'] == 'boom' %}{{ raise_exception('no boom here') }}{% endif %}
<|{{ m['role'] }}|> {{ m['content'] }} {{ eos_token }}
{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"""


def _talk(monkeypatch, capsys, args, lines):
    """Run ``npattn chat`` on ``lines`` of input: ``(exit status, stdout, stderr, [each turn's
    prompt ids])``, the prompts recorded from the real stream's calls."""
    import npattn.tools.generate as gen

    prompts = []
    real = gen.stream

    def recording(model, prompt, n, **kw):
        prompts.append(list(prompt))
        return real(model, prompt, n, **kw)

    monkeypatch.setattr(gen, "stream", recording)
    monkeypatch.setattr(sys, "stdin", io.StringIO("".join(line + "\n" for line in lines)))
    status = main(["chat", *args])
    out, err = capsys.readouterr()
    return status, out, err, prompts


def _ids(tok, directory, conversation):
    return tok.encode(
        apply_chat_template(directory, conversation, add_generation_prompt=True), add_special_tokens=False
    ).ids


def test_turns_carry_the_conversation_and_reset_empties_it(tmp_path, monkeypatch, capsys):
    tok, m = _chat_dir(tmp_path, template=ANY_ROLE)
    d = str(tmp_path)
    status, out, err, prompts = _talk(
        monkeypatch, capsys, [d, "--max-new-tokens", "4"], ["a bird", "", "the cat", "/reset", "a bird", "/exit", "x"]
    )
    assert status == 0 and err == "" and len(prompts) == 3  # the blank line is no turn; nothing after /exit
    first = [{"role": "user", "content": "a bird"}]
    assert prompts[0] == _ids(tok, d, first)
    reply = m.generate(np.array([prompts[0]]), 4)[0, len(prompts[0]) :].tolist()
    second = first + [{"role": "assistant", "content": tok.decode(reply)}, {"role": "user", "content": "the cat"}]
    assert prompts[1] == _ids(tok, d, second)  # the first reply is in the second prompt
    assert prompts[2] == prompts[0]  # /reset: a new conversation
    assert out.count(tok.decode(reply)) == 2 and out.count("[4 tokens in") == 3
    assert out.startswith("/reset starts a new conversation") and out.count("> ") == 6


def test_each_turn_runs_only_what_the_last_turn_did_not(tmp_path, monkeypatch, capsys):
    """The model's caches are kept from turn to turn: a turn's first forward runs its prompt after
    the prefix it shares with the last prompt and its reply's tokens fed (the rate line says how
    many were reused), and the replies are those of the whole prompt run afresh; /reset empties it."""
    tok, m = _chat_dir(tmp_path, template=ANY_ROLE)
    d = str(tmp_path)
    runs = []
    real = CausalLM.forward

    @functools.wraps(real)
    def counting(self, ids, **kw):
        runs.append(np.asarray(ids).shape[-1])
        return real(self, ids, **kw)

    monkeypatch.setattr(CausalLM, "forward", counting)
    status, out, err, prompts = _talk(
        monkeypatch, capsys, [d, "--max-new-tokens", "4"], ["a bird", "the cat", "my hat", "/reset", "a bird"]
    )
    assert status == 0 and err == "" and len(prompts) == 4 and len(runs) == 16  # the prompt's pass, 3 steps
    first = runs[0::4]  # each turn's prompt pass
    monkeypatch.undo()
    held: list = []
    for i, prompt in enumerate(prompts):
        reply = m.generate(np.array([prompt]), 4)[0, len(prompt) :].tolist()  # afresh, without the cache
        assert f"> {tok.decode(reply)}\n[4 tokens in" in out
        n = min(len(held), len(prompt) - 1)
        same = np.array(held[:n]) == np.array(prompt[:n])
        reused = n if same.all() else int(same.argmin())
        assert first[i] == len(prompt) - reused
        assert f"tokens/s, {reused} of {len(prompt)} prompt tokens reused]" in out
        held = [] if i == 2 else prompt + reply[:-1]  # /reset after the third turn
    assert 0 < first[1] < len(prompts[1]) and 0 < first[2] < len(prompts[2])
    assert first[3] == len(prompts[3])  # after /reset: all of it


def test_system_message_opens_every_conversation(tmp_path, monkeypatch, capsys):
    tok, _ = _chat_dir(tmp_path, template=ANY_ROLE)
    d = str(tmp_path)
    status, _, _, prompts = _talk(
        monkeypatch, capsys, [d, "--system", "be a cat", "--max-new-tokens", "2"], ["a bird", "/reset", "the dog"]
    )
    system = [{"role": "system", "content": "be a cat"}]
    assert status == 0 and prompts[0] == _ids(tok, d, system + [{"role": "user", "content": "a bird"}])
    assert prompts[1] == _ids(tok, d, system + [{"role": "user", "content": "the dog"}])


def test_a_turns_error_drops_that_message_and_goes_on(tmp_path, monkeypatch, capsys):
    tok, _ = _chat_dir(tmp_path, template=ANY_ROLE)
    d = str(tmp_path)
    status, _, err, prompts = _talk(monkeypatch, capsys, [d, "--max-new-tokens", "2"], ["boom", "a bird"])
    assert status == 0 and err.count("\n") == 1 and "npattn chat: --chat:" in err and "no boom here" in err
    assert prompts == [_ids(tok, d, [{"role": "user", "content": "a bird"}])]  # the end of input ends it


@pytest.mark.parametrize(
    "changes, args, word",
    [
        (dict(), ["--system", "be a cat"], "user and assistant only"),  # the test template refuses a system role
        (dict(template=None), [], "no chat template"),
        (dict(), ["--top-p", "2"], "top_p"),
    ],
)
def test_errors_before_the_first_prompt_are_one_line_exit_2(tmp_path, monkeypatch, capsys, changes, args, word):
    _chat_dir(tmp_path, **changes)  # test_cli_generate's template: user and assistant roles only
    status, out, err, prompts = _talk(monkeypatch, capsys, [str(tmp_path), *args], ["a bird"])
    assert status == 2 and out == "" and prompts == []
    assert err.startswith("npattn chat: ") and err.count("\n") == 1 and word in err


def test_without_a_tokenizer_it_says_what_to_do(tmp_path, monkeypatch, capsys):
    from test_cli_generate import _checkpoint

    _checkpoint(tmp_path, 40)
    status, out, err, _ = _talk(monkeypatch, capsys, [str(tmp_path)], ["a bird"])
    assert status == 2 and out == "" and "no tokenizer.json" in err and "--ids" not in err
