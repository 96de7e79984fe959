"""Tiny configs of each CausalLM family as plain Hugging Face config dicts (no transformers needed):
the tests' own copy of the one table, ``npattn.models.tiny.TINY_CONFIGS``."""

from npattn.models.tiny import TINY_CONFIGS, tiny_config

FAMILIES = {name: tiny_config(name) for name in TINY_CONFIGS}
