"""A checkpoint's tokenizer and chat template, without torch or transformers (the extra ``hf``).

A chat model is prompted with text laid out by its *chat template*, a Jinja program shipped with
the checkpoint (``chat_template.jinja``, or ``chat_template`` in ``tokenizer_config.json``; a GGUF
file's ``tokenizer.chat_template``), and the text becomes ids through its tokenizer::

    import numpy as np
    from npattn.models import CausalLM
    from npattn.models.chat import apply_chat_template, load_tokenizer

    model, tok = CausalLM.from_pretrained("Qwen3-0.6B"), load_tokenizer("Qwen3-0.6B")
    text = apply_chat_template("Qwen3-0.6B", [{"role": "user", "content": "Hi!"}],
                               add_generation_prompt=True, enable_thinking=False)
    ids = tok.encode(text, add_special_tokens=False).ids      # the template wrote the specials
    out = model.generate(np.array([ids]), 64)
    print(tok.decode(out[0, len(ids):].tolist(), skip_special_tokens=True))

``apply_chat_template`` renders as transformers' ``tokenizer.apply_chat_template(conversation,
tokenize=False, ...)`` does: jinja2's ``ImmutableSandboxedEnvironment`` (a template is a program
from the checkpoint: it may not reach Python's internals) with ``trim_blocks`` and
``lstrip_blocks``, the loop controls, ``raise_exception``, ``strftime_now`` and transformers' own
``tojson`` filter (no HTML escaping), the special tokens of ``tokenizer_config.json``
(``bos_token``, ``eos_token``, ...; a GGUF file's bos and eos) as variables, then
``conversation``, ``add_generation_prompt``, ``tools``, ``documents`` and any further keyword
(Qwen3's ``enable_thinking``).  ``load_tokenizer`` is the directory's ``tokenizer.json``, or the
tokenizer a GGUF file's metadata describes (``npattn.models.gguf.gguf_tokenizer``), as a
``tokenizers.Tokenizer``.
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Mapping, Sequence

from .._hints import install_hint

__all__ = ["apply_chat_template", "load_tokenizer", "read_chat_template"]

# transformers' PreTrainedTokenizerBase.SPECIAL_TOKENS_ATTRIBUTES: the template's variables
_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _where(path) -> str:
    """``path`` as a string: a directory, or a GGUF file (ValueError naming ``path`` otherwise)."""
    path = os.fspath(path)
    if not (os.path.isdir(path) or os.path.isfile(path)):
        raise ValueError(f"path: expected a checkpoint directory or a GGUF file, got {path!r} (no such file)")
    return path


def load_tokenizer(path):
    """The checkpoint's tokenizer as a ``tokenizers.Tokenizer``: ``tokenizer.json`` of a directory,
    or the one a GGUF file's metadata describes (``npattn.models.gguf.gguf_tokenizer``).

    Parameters
    ----------
    path : str or path
        A saved Hugging Face directory, or a GGUF file.

    Returns
    -------
    tokenizers.Tokenizer

    Raises
    ------
    ImportError
        Without the ``tokenizers`` package (the extra ``hf``; a GGUF file also needs ``gguf``).
    FileNotFoundError
        A directory without ``tokenizer.json``.
    ValueError
        ``path`` neither a directory nor a file; a ``tokenizer.json`` ``tokenizers`` cannot read;
        a GGUF tokenizer npattn does not rebuild (named).
    """
    path = _where(path)
    if os.path.isfile(path):
        from .gguf import gguf_tokenizer

        return gguf_tokenizer(path)
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ImportError(f"load_tokenizer needs the tokenizers package ({install_hint('hf')})") from None
    file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(file):
        raise FileNotFoundError(
            f"no tokenizer.json in {path!r}: copy the model's tokenizer.json there (from its Hugging Face repository)"
        )
    try:
        return Tokenizer.from_file(file)
    except Exception as e:  # tokenizers raises a bare Exception for every malformed file
        raise ValueError(f"{file}: not a readable tokenizer ({' '.join(str(e).split())})") from None


def read_chat_template(path) -> tuple:
    """``(template, special tokens, where)`` of a checkpoint: ``chat_template.jinja`` if the
    directory has one (transformers 5 saves it so and prefers it), else ``tokenizer_config.json``'s
    ``chat_template`` (a string, or a list of named templates whose ``"default"`` is taken), with
    its special tokens (strings, or added-token objects' ``content``); a GGUF file's
    ``tokenizer.chat_template`` with its bos and eos tokens.  ``template`` is None where there is
    none; ``where`` names the file it came from.

    Raises
    ------
    ValueError
        ``path`` neither a directory nor a file; a ``tokenizer_config.json`` that is not a JSON
        object (naming it).
    OSError
        A file that cannot be read.
    """
    path = _where(path)
    if os.path.isfile(path):
        from .gguf import gguf_chat_template

        template, special = gguf_chat_template(path)
        return (template if isinstance(template, str) else None), special, path
    cfg_path = os.path.join(path, "tokenizer_config.json")
    jinja_path = os.path.join(path, "chat_template.jinja")
    config: dict = {}
    where = cfg_path
    try:
        if os.path.isfile(cfg_path):
            with open(cfg_path, encoding="utf-8") as f:
                config = json.load(f)
            if not isinstance(config, dict):
                raise ValueError(f"expected a JSON object, got {type(config).__name__}")
        template = config.get("chat_template")
        if os.path.isfile(jinja_path):
            where = jinja_path
            with open(jinja_path, encoding="utf-8") as f:
                template = f.read()
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ValueError(f"cannot read {where} ({' '.join(str(e).split())})") from None
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    special = {}
    for name in _SPECIAL_TOKENS:
        value = config.get(name)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            special[name] = value
    return (template if isinstance(template, str) else None), special, where


def _check_conversation(conversation) -> list:
    """``conversation``: a list of messages, each a mapping with a ``"role"`` string."""
    if isinstance(conversation, (str, bytes, Mapping)) or not isinstance(conversation, Sequence):
        raise TypeError(
            "conversation: expected a list of messages ({'role': ..., 'content': ...}), got "
            f"{type(conversation).__name__}"
        )
    for i, m in enumerate(conversation):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise TypeError(f"conversation[{i}]: expected a mapping with a 'role' string, got {m!r}"[:300])
    return [dict(m) for m in conversation]


def apply_chat_template(path, conversation, *, add_generation_prompt=False, tools=None, documents=None, **kwargs):
    """The text of ``conversation`` laid out by the checkpoint's chat template, as transformers'
    ``tokenizer.apply_chat_template(conversation, tokenize=False, ...)`` renders it (the module
    docstring has the environment).  Encode it without adding special tokens (the template
    writes them): ``load_tokenizer(path).encode(text, add_special_tokens=False)``.

    Parameters
    ----------
    path : str or path
        A saved Hugging Face directory (``chat_template.jinja`` or ``tokenizer_config.json``), or
        a GGUF file.
    conversation : list of dict
        The messages, ``{"role": "system" | "user" | "assistant" | ..., "content": ...}``.
    add_generation_prompt : bool
        End with the header of the assistant's turn (to generate its reply), as transformers.
    tools, documents : list, optional
        Passed to the template, as transformers passes them.
    **kwargs
        Further variables of the template (Qwen3's ``enable_thinking=False``).

    Returns
    -------
    str

    Raises
    ------
    ImportError
        Without the ``jinja2`` package (the extra ``hf``).
    TypeError
        ``conversation`` not a list of mappings with a ``"role"``.
    ValueError
        No chat template (not a chat model); the template failed (a syntax error, its own
        ``raise_exception``, or a sandbox refusal), naming its file.

    Examples
    --------
    >>> import json, tempfile, os
    >>> from npattn.models.chat import apply_chat_template
    >>> d = tempfile.mkdtemp()
    >>> template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    >>> with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
    ...     json.dump({"chat_template": template + "{% if add_generation_prompt %}<assistant>{% endif %}"}, f)
    >>> apply_chat_template(d, [{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    '<user>Hi<assistant>'
    """
    messages = _check_conversation(conversation)
    try:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise ImportError(f"apply_chat_template needs the jinja2 package ({install_hint('hf')})") from None
    template, special, where = read_chat_template(path)
    if template is None:
        raise ValueError(
            f"no chat template in {os.fspath(path)!r} (neither chat_template.jinja nor a 'chat_template' string in "
            "tokenizer_config.json, or no tokenizer.chat_template in a GGUF file): the model may not be a chat model"
        )

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # transformers' own filter: jinja's would escape HTML characters
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    variables = {**special, **kwargs}
    variables.update(
        messages=messages, tools=tools, documents=documents, add_generation_prompt=bool(add_generation_prompt)
    )
    try:
        return env.from_string(template).render(**variables)
    except Exception as e:  # a template is a program: any error it raises is the template's
        text = " ".join(str(e).split())
        raise ValueError(f"{where}: the chat template failed ({type(e).__name__}: {text})") from None
