"""The refusals every multimodal checkpoint's loading test checks (Gemma 3, Gemma 4, Qwen3.5):
what the text model's loader does not read is refused by name, never set aside in silence."""

from __future__ import annotations

import json

import numpy as np
import pytest

from npattn.models import CausalLM
from npattn.models.hf import open_safetensors, save_safetensors


def assert_unread_parts_refused(directory, tensor: str, changes) -> None:
    """``directory`` (a saved multimodal checkpoint, one ``model.safetensors``) with ``tensor``, of
    no known tower, added is refused naming it; so is its config.json with each ``(change,
    match)`` of ``changes(config)`` applied (a top-level option, a disagreeing key ...).  The
    directory is left as it was."""
    weights, config = directory / "model.safetensors", directory / "config.json"
    tensors = {k: t.numpy() for k, t in open_safetensors(weights).items()}
    good = json.loads(config.read_text())
    save_safetensors(dict(tensors, **{tensor: np.ones(2)}), weights)
    with pytest.warns(UserWarning), pytest.raises(ValueError, match=repr(tensor)):
        CausalLM.from_pretrained(directory)
    save_safetensors(tensors, weights)
    for change, match in changes(good):
        config.write_text(json.dumps(dict(good, **change)))
        with pytest.raises(ValueError, match=match):
            CausalLM.from_pretrained(directory)
    config.write_text(json.dumps(good))
