"""Tiny configs of each CausalLM family as plain Hugging Face config dicts (no transformers needed):
the tests' own copy of the one table, ``npattn.models.tiny.TINY_CONFIGS``."""

from npattn.models.tiny import TINY_CONFIGS, tiny_config

FAMILIES = {name: tiny_config(name) for name in TINY_CONFIGS}


def one_rope_regime(name: str) -> dict:
    """``FAMILIES[name]`` with LongRoPE's switch (``original_max_position_embeddings``) past every
    length the tests feed: for the invariants that hold on either side of the switch but not across
    it, by transformers' own definition (a batch's frequencies follow its longest row; keys cached
    before the switch keep the short factors).  ``tests/test_phi3.py`` tests the switch itself."""
    cfg = dict(FAMILIES[name])
    if "original_max_position_embeddings" in cfg:
        cfg["original_max_position_embeddings"] = cfg["max_position_embeddings"] = 4096
    return cfg
