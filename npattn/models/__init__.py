"""Models built from npattn's modules.

* ``TinyTransformer``: a small GPT-style model assembled from the public pieces (``tiny.py``).
* ``CausalLM``: one config-driven decoder-only language model that loads Hugging Face
  checkpoints of the families of ``configs.SUPPORTED_MODEL_TYPES``, among them Llama 3, Mistral,
  Mixtral, Qwen2 to 3.5 and Qwen2-MoE, Gemma 2 to 4, GPT-OSS, DeepSeek-V3, OLMo, OLMo 2 and 3, OLMoE, SmolLM3,
  Phi-3, Granite 3 and 4.0, Falcon-H1, Nemotron-H, Mamba-2, Command R, R+ and R7B, GPT-NeoX, GPT-2, Phi-2,
  Arcee, Apertus, StarCoder2, Hunyuan dense, LFM2, EXAONE 4.0, ERNIE 4.5, GLM-4, Ministral and Ministral 3
  (``causal_lm.py``);
  ``CausalLMConfig`` is its configuration, made from a Hugging Face config
  dict by ``config_from_hf`` (``configs.py``); ``hf.py`` reads safetensors checkpoints without torch.
* ``load_tokenizer`` and ``apply_chat_template``: a checkpoint's tokenizer and its chat template
  rendered as transformers renders it (``chat.py``; the extra ``hf``).
"""

from .causal_lm import CausalLM
from .chat import apply_chat_template, load_tokenizer
from .configs import CausalLMConfig, config_from_hf
from .tiny import TinyTransformer

__all__ = ["TinyTransformer", "CausalLM", "CausalLMConfig", "config_from_hf", "load_tokenizer", "apply_chat_template"]
