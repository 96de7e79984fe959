"""``TinyTransformer``: a small causal (decoder-only) transformer assembled from public pieces.

It is written the way a user of npattn would write their own model: only ``Embedding``,
``EncoderBlock``, ``LayerNorm``, ``Linear``, ``ModuleList`` and the functional ``cross_entropy``
pair are used, and the backward pass is a dozen lines that walk the forward graph in reverse.

Typical training step::

    model = TinyTransformer(vocab_size=11, context_length=16, d_model=64, num_heads=4,
                            num_layers=2, d_ff=256, rng=0)
    opt = AdamW(model, lr=3e-3)
    opt.zero_grad()
    loss, dlogits = model.loss(ids, targets, ignore_index=-100)   # forward + dloss/dlogits
    model.backward(dlogits)                                       # every p.grad filled
    clip_grad_norm_(model, 1.0)
    opt.step()

The module also holds ``TINY_CONFIGS``, the one table of tiny Hugging Face configs of every
``CausalLM`` family (the tests, the bench, the guides build from it): ``tiny_config(family)`` is a
fresh copy of one, ``scaled_config(family, hidden=..., layers=..., vocab=...)`` the same options at
other sizes.
"""

from __future__ import annotations

import copy
import math

import numpy as np

from .. import functional as F
from .._validate import as_index, as_rng, check_dtype, check_positive_float, check_prob, check_size
from ..nn.containers import ModuleList
from ..nn.layers import Embedding, LayerNorm, Linear
from ..nn.module import Module, no_grad
from ..nn.transformer import EncoderBlock

__all__ = ["TinyTransformer", "TINY_CONFIGS", "tiny_config", "scaled_config"]


class TinyTransformer(Module):
    """A GPT-style causal language model: ``ids (..., L) -> logits (..., L, vocab_size)``.

    Forward::

        x = tok_emb(ids) + pos_emb(arange(L))      # (..., L, d_model)
        for block in blocks:                        # pre-norm, causal EncoderBlocks
            x = block(x)
        logits = head(norm(x))                      # (..., L, vocab_size)

    Position ``t`` only sees tokens ``0..t`` (causal attention), so ``logits[..., t, :]`` is a
    prediction of token ``t + 1``.

    Backward (``backward(dlogits)``) visits the same modules in the opposite order, each
    module's ``backward`` consuming the gradient of its output and returning that of its input:

    1. ``head.backward`` then ``norm.backward`` give ``dx``, the gradient of the last residual
       stream;
    2. each block, last to first: ``dx = block.backward(dx)`` (the block handles its own two
       residual branches);
    3. ``x = tok + pos`` is a sum, so both embeddings receive ``dx`` unchanged:
       ``tok_emb.backward(dx)`` scatters it into the rows of the used tokens, and the position
       table, shared by every sequence of the batch, gets ``dx`` summed over the batch axes.

    Every parameter gradient is *added* into ``p.grad`` (call ``zero_grad()`` between steps).
    Token ids have no gradient, so ``backward`` returns ``None``.

    State-dict keys: ``tok_emb.weight``, ``pos_emb.weight``, ``blocks.{i}.mha.*``,
    ``blocks.{i}.ffn.*``, ``blocks.{i}.layernorm{1,2}.*``, ``norm.weight``, ``norm.bias``,
    ``head.weight``, ``head.bias``.

    ``activation`` is the feed-forward's (``"relu"``, ``"gelu"``, ``"gelu_tanh"``).  Embedding
    tables start as N(0, ``embedding_std``²) (default 0.02, the GPT-2 choice; 1.0 gives torch's
    ``nn.Embedding`` default); everything else uses its layer's default initialisation.

    Examples
    --------
    >>> import numpy as np
    >>> import npattn
    >>> model = npattn.TinyTransformer(vocab_size=10, context_length=8, d_model=16, num_heads=2,
    ...                                num_layers=1, d_ff=32, rng=0)
    >>> ids = np.array([[1, 2, 3, 4]])
    >>> model(ids).shape
    (1, 4, 10)
    >>> loss, dlogits = model.loss(ids, np.array([[2, 3, 4, 5]]))
    >>> model.backward(dlogits) is None, 1.5 < loss < 3.5          # about ln 10 = 2.3 at the start
    (True, True)
    """

    def __init__(
        self,
        vocab_size,
        context_length,
        d_model,
        num_heads,
        num_layers,
        d_ff,
        *,
        dropout=0.0,
        activation="relu",
        embedding_std=0.02,
        rng=None,
        dtype=np.float64,
    ):
        super().__init__()
        self.vocab_size = check_size(vocab_size, "vocab_size")
        self.context_length = check_size(context_length, "context_length")
        self.num_layers = check_size(num_layers, "num_layers")
        check_prob(dropout, "dropout")
        # bool and str: TypeError; inf, nan, <= 0: ValueError
        embedding_std = check_positive_float(embedding_std, "embedding_std")
        self._dtype = check_dtype(dtype)
        rng = as_rng(rng)
        self.tok_emb = Embedding(vocab_size, d_model, rng=rng, dtype=dtype)
        self.pos_emb = Embedding(context_length, d_model, rng=rng, dtype=dtype)
        for emb in (self.tok_emb, self.pos_emb):
            emb.weight.data *= self._dtype.type(embedding_std)
        self.blocks = ModuleList(
            [
                EncoderBlock(
                    d_model,
                    num_heads,
                    d_ff,
                    dropout=dropout,
                    activation=activation,
                    norm_first=True,
                    causal=True,
                    rng=rng,
                    dtype=dtype,
                )
                for _ in range(self.num_layers)
            ]
        )
        self.norm = LayerNorm(d_model, dtype=dtype)
        self.head = Linear(d_model, vocab_size, rng=rng, dtype=dtype)

    def extra_repr(self):
        """The arguments shown by ``repr(module)``."""
        return f"vocab_size={self.vocab_size}, context_length={self.context_length}"

    # -- forward / backward ----------------------------------------------------------------
    def _check_ids(self, ids):
        ids = as_index(ids, "ids")
        if ids.ndim < 1 or not 1 <= ids.shape[-1] <= self.context_length:
            raise ValueError(
                f"ids: expected shape (..., L) with 1 <= L <= context_length={self.context_length}, got {ids.shape}"
            )
        return ids

    def _embed(self, ids):
        positions = np.arange(ids.shape[-1])
        return self.tok_emb(ids) + self.pos_emb(positions)  # (..., L, d) + (L, d)

    def forward(self, ids):
        """``ids (..., L)`` integer token ids, ``L <= context_length`` -> ``logits (..., L, vocab_size)``."""
        ids = self._check_ids(ids)
        x = self._embed(ids)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        self.save_for_backward(ids.shape)
        return logits

    def backward(self, dlogits):
        """Accumulate every parameter's gradient from ``dlogits`` (the gradient of the logits);
        returns ``None`` (token ids have no gradient).  See the class docstring for the order."""
        dlogits = self._check_dy(dlogits, "dlogits")
        ids_shape = self.pop_saved()
        dx = self.norm.backward(self.head.backward(dlogits))
        for block in reversed(list(self.blocks)):
            dx = block.backward(dx)
        self.tok_emb.backward(dx)
        batch_axes = tuple(range(len(ids_shape) - 1))
        self.pos_emb.backward(dx.sum(axis=batch_axes))  # one position table shared by the batch
        return None

    def _jvp(self, state, input_tangents, param_tangents):
        """Forward mode: the logits' tangent along the parameters' tangents (token ids have
        none: pass None or nothing), the forward's chain run on tangents; ``x = tok + pos``
        gives ``tx = ttok + tpos`` (the position table's tangent rows broadcast over the batch)."""

        def sub(m, t):  # the submodule's tangent from its state of this call
            return self._child_jvp(m, -1, (t,), param_tangents)

        tx = self._child_jvp(self.tok_emb, -1, input_tangents, param_tangents)  # refuses an ids tangent
        tx = tx + sub(self.pos_emb, None)
        for block in self.blocks:
            tx = sub(block, tx)
        return sub(self.head, sub(self.norm, tx))

    def _backward_jvp(self, state, dy, input_tangents, param_tangents, ddy):
        """Second order: the forward's tangents (as ``_jvp``: each block's input tangent), then
        ``head``, ``norm``, the blocks last to first and both embeddings by their
        ``backward_jvp`` (the position table's gradient and its tangent summed over the batch).
        Token ids take no tangent; returns ``(None, None)``."""
        ids_shape = state

        def sub(m, t):  # the submodule's tangent from its state of this call
            return self._child_jvp(m, -1, (t,), param_tangents)

        def back(m, g, t):  # its backward_jvp on (gradient, tangent), its input's tangent t
            return self._child_backward_jvp(m, g[0], (t,), param_tangents, g[1])

        tx = self._child_jvp(self.tok_emb, -1, input_tangents, param_tangents)  # refuses an ids tangent
        inputs = [tx + sub(self.pos_emb, None)]
        for block in self.blocks:
            inputs.append(sub(block, inputs[-1]))
        g = back(self.norm, back(self.head, (dy, ddy), sub(self.norm, inputs[-1])), inputs[-1])
        for block, t in zip(reversed(list(self.blocks)), reversed(inputs[:-1])):
            g = back(block, g, t)
        back(self.tok_emb, g, None)
        batch = tuple(range(len(ids_shape) - 1))
        back(self.pos_emb, (g[0].sum(axis=batch), g[1].sum(axis=batch)), None)
        return None, None

    def loss(self, ids, targets, *, ignore_index=None):
        """Forward pass and mean cross-entropy of ``targets (..., L)`` under the logits.

        Targets equal to ``ignore_index`` are not counted (e.g. the prompt part of a sequence).
        Returns ``(loss, dlogits)``: the loss as a python float and its gradient with respect to
        the logits, ready for ``model.backward(dlogits)``.
        """
        logits = self.forward(ids)
        loss, cache = F.cross_entropy(logits, targets, ignore_index=ignore_index)
        dlogits = F.cross_entropy_backward(np.ones((), dtype=logits.dtype), cache)
        return float(loss), dlogits

    # -- inference helpers -----------------------------------------------------------------
    def _inference(self, fn):
        was_training = self.training
        self.eval()
        try:
            with no_grad():
                return fn()
        finally:
            self.train(was_training)

    def generate(self, ids, max_new_tokens, *, temperature=0.0, top_k=None, eos_id=None, rng=None):
        """Autoregressive decoding: append up to ``max_new_tokens`` tokens, each predicted from
        everything before it.  ``ids (..., L)``; returns ``(..., L + new)``.

        Greedy (the arg-max) by default; ``temperature > 0`` samples from
        ``softmax(logits / temperature)`` after ``top_k`` (all but the ``top_k`` largest logits
        become ``-inf``); ``eos_id`` stops once every sequence has produced it (that last
        ``eos_id`` is not appended; sequences that finished earlier are padded with it); ``rng``
        (Generator, int seed or None) makes sampling reproducible.  The same implementation as
        ``npattn.book.generate`` (``npattn.generation.generate``).  Runs in eval mode without
        keeping backward state and restores the mode.
        """
        from ..generation import generate

        ids = self._check_ids(ids)
        n = check_size(max_new_tokens, "max_new_tokens", minimum=0)
        if ids.shape[-1] + n > self.context_length + 1:
            raise ValueError(
                f"max_new_tokens: {ids.shape[-1]} prompt tokens + {n} new tokens need a context of "
                f"{ids.shape[-1] + n - 1}, more than context_length={self.context_length}"
            )
        return generate(self, ids, n, self.context_length, temperature, top_k, eos_id, rng=rng, use_cache=False)

    def attention_weights(self, ids):
        """The attention weights of every layer and head for ``ids (..., L)``, in eval mode:
        an array ``(num_layers, ..., num_heads, L, L)`` (row ``i`` is query position ``i``).

        Each block is re-run step by step: its ``mha`` is called with ``need_weights=True`` on
        the normalised input (what the pre-norm block feeds it), then the block itself advances
        the residual stream.  Nothing is kept for backward.
        """
        ids = self._check_ids(ids)

        def run():
            x = self._embed(ids)
            weights = []
            for block in self.blocks:
                _, w = block.mha(block.layernorm1(x), need_weights=True)
                weights.append(w)
                x = block(x)
            return np.stack(weights)

        return self._inference(run)


# -- the tiny configs of the CausalLM families ----------------------------------------------------
# width 16, 4 query heads sharing 2 key/value heads, 2 layers (an entry overrides what differs)
_HEADS = dict(num_attention_heads=4, num_key_value_heads=2)
_BASE = dict(vocab_size=41, hidden_size=16, intermediate_size=24, **_HEADS, num_hidden_layers=2)
# MLA's head sizes (deepseek_v3, deepseek_v32, kimi_linear)
_MLA_HEADS = dict(kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4)
# DeepSeek-V3's MLA with a dense first layer and routed experts in groups (deepseek_v3, deepseek_v32)
_DEEPSEEK_V3 = dict(
    _BASE,
    num_key_value_heads=4,
    first_k_dense_replace=1,
    moe_intermediate_size=8,
    n_routed_experts=4,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    routed_scaling_factor=2.5,
    q_lora_rank=8,
    **_MLA_HEADS,
)

# Qwen3-MoE's routed experts (qwen3_moe; with a gated shared expert: qwen3_next, qwen3_5_moe_text)
_QWEN_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8)
# Qwen3-Next's Gated DeltaNet layer before a full-attention one (qwen3_next, qwen3_5_text, qwen3_5_moe_text)
_LINEAR_HEADS = dict(linear_key_head_dim=4, linear_value_head_dim=4, linear_num_key_heads=2, linear_num_value_heads=4)
_GATED_DELTA = dict(
    _LINEAR_HEADS, head_dim=4, layer_types=["linear_attention", "full_attention"], linear_conv_kernel_dim=3
)
_SHARED_EXPERT_MOE = dict(_QWEN_MOE, shared_expert_intermediate_size=8)

# Gemma's scores scaled apart from head_dim, a window of 3, a final softcap, a tied head, a pad row
# (gemma2, gemma3_text)
_GEMMA = dict(
    _BASE,
    head_dim=4,
    query_pre_attn_scalar=8,
    sliding_window=3,
    final_logit_softcapping=30.0,
    tie_word_embeddings=True,
    pad_token_id=0,
)

#: One tiny Hugging Face config dict per ``CausalLM`` family (``model_type``), each exercising the
#: family's own options (windows, softcapping, sinks and YaRN, MLA and routed experts, DeltaNet and
#: a gated shared expert) at width 16 with 2 layers: the table the tests, the bench
#: (``scaled_config``), the notebooks and the guides build from.  Read it; change a copy
#: (``tiny_config``).  Adding a family to ``CausalLM`` adds its entry here.
TINY_CONFIGS: dict = {
    "llama": dict(_BASE, model_type="llama", attention_bias=True, rope_theta=500.0),
    "qwen3": dict(
        _BASE,
        model_type="qwen3",
        head_dim=4,
        use_sliding_window=True,
        sliding_window=3,
        max_window_layers=1,
        tie_word_embeddings=True,
    ),
    "qwen3_moe": dict(
        _BASE,
        model_type="qwen3_moe",
        head_dim=8,
        **_QWEN_MOE,
        norm_topk_prob=True,
        mlp_only_layers=[1],
    ),
    "gemma3_text": dict(_GEMMA, model_type="gemma3_text", layer_types=["sliding_attention", "full_attention"]),
    "gpt_oss": dict(
        _BASE,
        model_type="gpt_oss",
        head_dim=4,
        sliding_window=3,
        num_local_experts=4,
        num_experts_per_tok=2,
        rope_parameters={
            "rope_type": "yarn",
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 16,
            "rope_theta": 1000.0,
        },
    ),
    "deepseek_v3": dict(_DEEPSEEK_V3, model_type="deepseek_v3"),
    "deepseek_v32": dict(  # DeepSeek-V3.2: every layer's MLA restricted to the indexer's top 3 keys
        _DEEPSEEK_V3,
        model_type="deepseek_v32",
        index_topk=3,
        index_n_heads=16,  # many heads: a score of exactly 0 (every head's ReLU at 0) ties too rarely to matter
        index_head_dim=8,
        pad_token_id=0,
    ),
    "qwen3_next": dict(
        _BASE,
        model_type="qwen3_next",
        **_GATED_DELTA,
        **_SHARED_EXPERT_MOE,
        partial_rotary_factor=0.5,
    ),
    "kimi_linear": dict(  # KDA and NoPE MLA layers mixed (1-indexed lists), a dense layer, then routed experts
        _BASE,
        model_type="kimi_linear",
        num_hidden_layers=3,
        num_key_value_heads=4,
        linear_attn_config={
            "num_heads": 2,
            "head_dim": 4,
            "short_conv_kernel_size": 3,
            "kda_layers": [1, 3],
            "full_attn_layers": [2],
        },
        first_k_dense_replace=1,
        moe_intermediate_size=8,
        num_experts=4,
        num_experts_per_token=2,
        num_shared_experts=1,
        num_expert_group=2,
        topk_group=1,
        routed_scaling_factor=2.5,
        **_MLA_HEADS,
        eos_token_id=2,
        pad_token_id=0,
        bos_token_id=1,
    ),
    "olmo3": dict(
        _BASE,
        model_type="olmo3",
        sliding_window=3,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 5000.0},
        },
        attention_bias=True,
        eos_token_id=2,
    ),
    "qwen3_5_text": dict(
        _BASE,
        model_type="qwen3_5_text",
        **_GATED_DELTA,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 1000.0,
            "partial_rotary_factor": 0.5,
            "mrope_section": [1, 0, 0],
            "mrope_interleaved": True,
        },
    ),
    "qwen3_5_moe_text": dict(
        {k: v for k, v in _BASE.items() if k != "intermediate_size"},  # no dense MLP
        model_type="qwen3_5_moe_text",
        **_GATED_DELTA,
        **_SHARED_EXPERT_MOE,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 0.5},
    ),
    # Gemma 4: the last three layers reuse keys and values (two of them the same sliding layer's,
    # the last the first full layer's), the full-attention layers with their own wider heads, one
    # kv head used as keys and values (k_eq_v) and proportional RoPE; per-layer input embeddings;
    # a final softcap
    "gemma4_text": dict(
        _BASE,
        model_type="gemma4_text",
        num_hidden_layers=6,
        head_dim=4,
        global_head_dim=8,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        num_kv_shared_layers=3,
        layer_types=["sliding_attention", "full_attention"] + ["sliding_attention"] * 3 + ["full_attention"],
        sliding_window=3,
        hidden_size_per_layer_input=4,
        vocab_size_per_layer_input=41,
        final_logit_softcapping=30.0,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 1000.0},
        },
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    ),
    "mistral": dict(_BASE, model_type="mistral", head_dim=8, sliding_window=3),
    # Mixtral: Mistral's window of 3 and wider heads, 4 experts of which each token takes 2
    "mixtral": dict(
        _BASE,
        model_type="mixtral",
        head_dim=8,
        sliding_window=3,
        num_local_experts=4,
        num_experts_per_tok=2,
        rope_theta=1000.0,
    ),
    # Qwen1.5-MoE / Qwen2-MoE: the first layer sliding (max_window_layers), the middle one dense
    # (mlp_only_layers), the others routed beside the gated shared expert; biases on q, k, v
    "qwen2_moe": dict(
        _BASE,
        model_type="qwen2_moe",
        num_hidden_layers=3,
        **_SHARED_EXPERT_MOE,
        mlp_only_layers=[1],
        use_sliding_window=True,
        sliding_window=3,
        max_window_layers=2,
        rope_theta=1000.0,
    ),
    # OLMoE: OLMo's q/k norms over the whole projection in pre-norm layers, biases on the
    # attention, 4 experts top 2 left unnormalised
    "olmoe": dict(
        _BASE,
        model_type="olmoe",
        num_experts=4,
        num_experts_per_tok=2,
        attention_bias=True,
        rope_theta=1000.0,
        pad_token_id=1,
        eos_token_id=2,
    ),
    "qwen2": dict(_BASE, model_type="qwen2", use_sliding_window=True, sliding_window=3, max_window_layers=1),
    "gemma2": dict(_GEMMA, model_type="gemma2", attn_logit_softcapping=2.0),
    "olmo2": dict(_BASE, model_type="olmo2", rope_theta=5000.0, attention_bias=True, eos_token_id=2),
    # The first OLMo: Llama's pre-norm layers on LayerNorms without weight or bias, q/k/v/o biases,
    # GQA, a tied head
    "olmo": dict(
        _BASE,
        model_type="olmo",
        num_key_value_heads=1,
        rope_theta=5000.0,
        attention_bias=True,
        tie_word_embeddings=True,
        pad_token_id=1,
        eos_token_id=2,
    ),
    # SmolLM3: every second layer NoPE (no rotation) and sliding through a window of 3, a tied head
    "smollm3": dict(
        _BASE,
        model_type="smollm3",
        num_hidden_layers=4,
        no_rope_layer_interval=2,
        use_sliding_window=True,
        sliding_window=3,
        rope_theta=1000.0,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    ),
    # Phi-3 / Phi-4-mini: partial rotary (6 of 8 features), LongRoPE with an original context of 4
    # (the tests' sequences cross it: the long factors), a tied head, the fused checkpoint names
    "phi3": dict(
        _BASE,
        model_type="phi3",
        num_attention_heads=2,
        num_key_value_heads=1,
        partial_rotary_factor=0.75,
        max_position_embeddings=32,
        original_max_position_embeddings=4,
        rope_theta=1000.0,
        rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.25, 1.5], "long_factor": [1.5, 3.0, 6.0]},
        tie_word_embeddings=True,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    ),
    # LFM2: a gated short convolution (3 taps) before an attention layer with QK-norm, the MLP's
    # width adjusted (int(2 * 24 / 3) = 16, a multiple of 8), a tied head (its default)
    "lfm2": dict(
        _BASE,
        model_type="lfm2",
        layer_types=["conv", "full_attention"],
        conv_L_cache=3,
        block_multiple_of=8,
        rope_theta=1000.0,
    ),
    # LFM2-MoE: LFM2's short convolution with a dense MLP, then an attention layer with routed
    # experts (sigmoid scores, the top 2 of 4 chosen through the expert bias, renormalised, times 1.5)
    "lfm2_moe": dict(
        _BASE,
        model_type="lfm2_moe",
        layer_types=["conv", "full_attention"],
        num_dense_layers=1,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=8,
        routed_scaling_factor=1.5,
        rope_theta=1000.0,
    ),
    # Falcon-H1: two hybrid layers (attention with head_dim 6 beside a Mamba-2 mixer of 4 heads of 6
    # in 2 groups, state 4, 3 taps, chunks of 4, its grouped norm before the gate), every muP factor
    # away from 1, out_proj's bias
    "falcon_h1": dict(
        _BASE,
        model_type="falcon_h1",
        head_dim=6,
        mamba_d_ssm=24,
        mamba_n_heads=4,
        mamba_d_head=6,
        mamba_n_groups=2,
        mamba_d_state=4,
        mamba_d_conv=3,
        mamba_chunk_size=4,
        mamba_rms_norm=True,
        mamba_norm_before_gate=True,
        projectors_bias=True,
        rope_theta=1000.0,
        embedding_multiplier=2.5,
        lm_head_multiplier=0.4,
        key_multiplier=0.7,
        attention_in_multiplier=1.2,
        attention_out_multiplier=0.9,
        ssm_in_multiplier=1.25,
        ssm_out_multiplier=0.6,
        mlp_multipliers=[0.8, 0.55],
        ssm_multipliers=[0.35, 0.75, 1.3, 0.5, 0.6],
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    ),
    # Nemotron-H: a Mamba-2 block (4 heads of 6 in 2 groups, state 4, 3 taps, chunks of 4), a relu2
    # MLP block, an attention block without RoPE (head_dim 6), another MLP block
    "nemotron_h": dict(
        _BASE,
        model_type="nemotron_h",
        hybrid_override_pattern="M-*-",
        num_hidden_layers=4,
        head_dim=6,
        mamba_num_heads=4,
        mamba_head_dim=6,
        n_groups=2,
        ssm_state_size=4,
        conv_kernel=3,
        chunk_size=4,
        time_step_min=0.01,
        layer_norm_epsilon=1e-5,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    ),
    # Command R7B: three parallel blocks (attention and MLP on one bias-free LayerNorm), the default
    # pattern of period 2 (sliding, full, sliding), RoPE on interleaved pairs on the sliding layers
    # only (window 3), the logits times 0.4, a tied head (no attention biases: a key's bias on a
    # layer without RoPE moves every score of a query alike, its gradient zero but for rounding)
    "cohere2": dict(
        _BASE,
        model_type="cohere2",
        num_hidden_layers=3,
        sliding_window_pattern=2,
        sliding_window=3,
        logit_scale=0.4,
        layer_norm_eps=1e-4,
        rope_theta=1000.0,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    ),
    # Command R (R+'s q/k norms): two parallel blocks, full attention with interleaved RoPE on every
    # layer, a bias-free LayerNorm of each head's q and k (a weight row per head), the logits times
    # 0.3, attention biases, an untied head
    "cohere": dict(
        _BASE,
        model_type="cohere",
        use_qk_norm=True,
        logit_scale=0.3,
        layer_norm_eps=1e-4,
        attention_bias=True,
        rope_theta=1000.0,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    ),
    # Nemotron 3 (Nano 30B-A3B's kind of blocks): Nemotron-H's with routed experts, "E": 2 of 4 experts
    # that are not gated (relu2) in 2 groups (one chosen), sigmoid scores, the shared expert, a latent width
    "nemotron_h_moe": dict(
        _BASE,
        model_type="nemotron_h",
        hybrid_override_pattern="ME*-E",
        num_hidden_layers=5,
        head_dim=6,
        mamba_num_heads=4,
        mamba_head_dim=6,
        n_groups=2,
        ssm_state_size=4,
        conv_kernel=3,
        chunk_size=4,
        time_step_min=0.01,
        layer_norm_epsilon=1e-5,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=6,
        moe_shared_expert_intermediate_size=10,
        moe_latent_size=8,
        n_group=2,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    ),
    # GPT-NeoX (Pythia): two parallel-residual layers (two LayerNorms with biases), 4 heads of 4 with
    # half of each rotated (rotary_pct 0.5, rotate-half pairs), the fused per-head query_key_value with
    # its bias, the plain gelu MLP with biases, an untied embed_out head
    "gpt_neox": dict(
        _BASE,
        model_type="gpt_neox",
        num_key_value_heads=None,
        rotary_pct=0.5,
        rotary_emb_base=1000.0,
        layer_norm_eps=1e-4,
        use_parallel_residual=True,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    ),
    # Phi-2: two parallel blocks on one LayerNorm with a bias, 4 heads of 4 over 2 KV heads with half
    # of each rotated, biases everywhere (the head's too), the plain gelu_new MLP 4x wide
    "phi": dict(
        _BASE,
        model_type="phi",
        intermediate_size=64,
        partial_rotary_factor=0.5,
        rope_theta=1000.0,
        layer_norm_eps=1e-4,
        resid_pdrop=0.1,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    ),
    # StableLM-2-12B's shape at its smallest: the MLP beside the attention on one LayerNorm with a
    # bias, a bias-free LayerNorm of each head's q and k (a weight row a head), q, k, v with biases,
    # 4 heads of 4 over 2 KV heads with half of each rotated, the gated silu MLP
    "stablelm": dict(
        _BASE,
        model_type="stablelm",
        partial_rotary_factor=0.5,
        rope_theta=1000.0,
        layer_norm_eps=1e-4,
        use_qkv_bias=True,
        qk_layernorm=True,
        use_parallel_residual=True,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    ),
    # GPT-2: learned absolute positions (wpe) instead of RoPE, two pre-LayerNorm blocks with biases,
    # the fused c_attn with its bias over 4 heads of 4, the plain gelu_new MLP with biases, the
    # Conv1D weights (in, out) in its checkpoints, the head tied to wte; dropout keys at their 0.1
    "gpt2": dict(
        model_type="gpt2",
        vocab_size=41,
        hidden_size=16,
        n_inner=24,
        num_attention_heads=4,
        num_hidden_layers=2,
        max_position_embeddings=128,
        layer_norm_epsilon=1e-4,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    ),
    # StarCoder2: two pre-norm layers on LayerNorms with biases, 4 heads of 4 over 2 KV heads, a window
    # of 4 keys on every layer, biases on q, k, v, o and the plain gelu_pytorch_tanh MLP, a tied head
    "starcoder2": dict(
        _BASE,
        model_type="starcoder2",
        intermediate_size=64,
        rope_theta=1000.0,
        norm_epsilon=1e-4,
        sliding_window=4,
        residual_dropout=0.1,
        embedding_dropout=0.1,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    ),
    # Mamba-2: two blocks of a mixer alone (4 heads of 8 in 2 groups, state 4, 3 taps with their
    # bias, chunks of 4), no attention and no MLP (tests/test_mamba2_lm.py: in_proj/out_proj biases, a tied
    # head, a clipped step)
    "mamba2": dict(
        model_type="mamba2",
        vocab_size=41,
        hidden_size=16,
        num_hidden_layers=2,
        num_heads=4,
        head_dim=8,
        expand=2,
        n_groups=2,
        state_size=4,
        conv_kernel=3,
        chunk_size=4,
        layer_norm_epsilon=1e-5,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    ),
    # Granite 3.x: Llama's layer with its four numbers away from 1 (embeddings times 3, each branch
    # times 0.5, the scores times 0.3 instead of 1/sqrt(8), the logits over 2.5), biases, a tied head
    "granite": dict(
        _BASE,
        model_type="granite",
        embedding_multiplier=3.0,
        residual_multiplier=0.5,
        attention_multiplier=0.3,
        logits_scaling=2.5,
        attention_bias=True,
        mlp_bias=True,
        rope_theta=1000.0,
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    ),
    # Granite MoE: the same numbers, every layer's MLP 2 of 4 routed experts (top-k logits, softmax
    # among them) under block_sparse_moe, the released checkpoints' fused input_linear / output_linear
    "granitemoe": dict(
        _BASE,
        model_type="granitemoe",
        intermediate_size=8,
        num_local_experts=4,
        num_experts_per_tok=2,
        embedding_multiplier=2.0,
        residual_multiplier=0.7,
        attention_multiplier=0.4,
        logits_scaling=1.5,
        rope_theta=1000.0,
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    ),
    # EXAONE 4.0: post-norm layers with per-head QK-norm; a sliding layer (a window of 3, RoPE) then
    # a full one without RoPE (sliding_window_pattern 2: the 32B's hybrid of "global NoPE" at a
    # shorter period); Llama 3's RoPE scaling (the releases' kind) with pairs kept, divided and in
    # between; a tied head (the 1.2B's)
    "exaone4": dict(
        _BASE,
        model_type="exaone4",
        head_dim=8,
        sliding_window=3,
        sliding_window_pattern=2,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 1000.0,
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    ),
    # ERNIE 4.5: RoPE on interleaved pairs (2i, 2i+1), use_bias on all seven projections, heads of
    # 8 wider than hidden / heads, a tied head (its default)
    "ernie4_5": dict(
        _BASE,
        model_type="ernie4_5",
        head_dim=8,
        use_bias=True,
        rope_theta=1000.0,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    ),
    # Arcee (AFM-4.5B): Llama's layers, a non-gated relu2 MLP (up, down; with biases here), heads of
    # 8 wider than hidden / heads, YaRN (factor 4 over 8 original positions) as AFM-4.5B's, untied
    "arcee": dict(
        _BASE,
        model_type="arcee",
        head_dim=8,
        mlp_bias=True,
        max_position_embeddings=32,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 1000.0,
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "original_max_position_embeddings": 8,
        },
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    ),
    # GLM-4 (0414, Z1): heads of 8 wider than hidden / heads, half of each rotating (its default
    # partial_rotary_factor) on interleaved pairs, biases on q/k/v only (its default), plain norms
    # after both sublayers too under GLM's names, the fused gate_up_proj, an untied head (its default)
    "glm4": dict(
        _BASE,
        model_type="glm4",
        head_dim=8,
        rope_theta=1000.0,
        rms_norm_eps=1e-5,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    ),
    # Apertus: per-head q/k norms, biases on q, k, v and o, the non-gated xIELU MLP (its alpha_p,
    # alpha_n parameters and beta, eps buffers), heads of 8 wider than hidden / heads, Llama 3's
    # RoPE scaling over 4 original positions
    "apertus": dict(
        _BASE,
        model_type="apertus",
        head_dim=8,
        attention_bias=True,
        max_position_embeddings=32,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 1000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 4,
            "low_freq_factor": 1.0,
            "high_freq_factor": 2.0,
        },
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    ),
    # Ministral 3: Mistral's layers without a window, YaRN over 2 original positions, so that the
    # queries' scale by position (1 + beta log(1 + floor(p / 2))) is not 1 past the second token
    "ministral3": dict(
        _BASE,
        model_type="ministral3",
        head_dim=8,
        max_position_embeddings=64,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 1000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 2,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "llama_4_scaling_beta": 0.5,
        },
    ),
    # Ministral (8B-2410): Mistral's layers, layer_types naming the first sliding (a window of 3),
    # the second full; a pad row (finished rows of a generated batch continue with it)
    "ministral": dict(
        _BASE,
        model_type="ministral",
        head_dim=8,
        sliding_window=3,
        layer_types=["sliding_attention", "full_attention"],
        rope_theta=1000.0,
        pad_token_id=0,
    ),
    # Hunyuan dense: the QK-norm after RoPE, NTK-alpha RoPE as the releases write it ("dynamic" with
    # an alpha beside YaRN's unread keys), heads of 8 wider than hidden / heads, biases on the
    # attention's four projections
    "hunyuan_v1_dense": dict(
        _BASE,
        model_type="hunyuan_v1_dense",
        head_dim=8,
        attention_bias=True,
        rope_parameters={
            "rope_type": "dynamic",
            "alpha": 3.0,
            "factor": 1.0,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "rope_theta": 1000.0,
        },
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    ),
    # GraniteMoeShared: Granite MoE (2 of 4 experts, untied) plus a shared MLP of width 12 on the
    # same input, its fused input_linear as the checkpoints write it
    "granitemoeshared": dict(
        _BASE,
        model_type="granitemoeshared",
        intermediate_size=8,
        num_local_experts=4,
        num_experts_per_tok=2,
        shared_intermediate_size=12,
        embedding_multiplier=0.8,
        residual_multiplier=1.3,
        attention_multiplier=0.35,
        logits_scaling=2.0,
        rope_theta=1000.0,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    ),
    # Granite 4.0 hybrid (granite-4.0-h-tiny's shape): a Mamba-2 layer (4 heads of 8 in 2 groups,
    # state 4, 3 taps with their bias, chunks of 4) before an attention layer without positions
    # ("nope", as the hybrid releases), each layer's MLP 2 of 4 experts beside the shared MLP, a
    # tied head (the all-attention releases: tests/test_granite_shared.py)
    "granitemoehybrid": dict(
        _BASE,
        model_type="granitemoehybrid",
        layer_types=["mamba", "attention"],
        position_embedding_type="nope",
        intermediate_size=8,
        num_local_experts=4,
        num_experts_per_tok=2,
        shared_intermediate_size=12,
        mamba_n_heads=4,
        mamba_d_head=8,
        mamba_n_groups=2,
        mamba_d_state=4,
        mamba_d_conv=3,
        mamba_expand=2,
        mamba_chunk_size=4,
        embedding_multiplier=2.5,
        residual_multiplier=0.45,
        attention_multiplier=0.3,
        logits_scaling=3.0,
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    ),
}


def tiny_config(model_type: str, **changes) -> dict:
    """A fresh copy of ``TINY_CONFIGS[model_type]`` with ``changes`` (keys of the config).

    Raises
    ------
    ValueError
        ``model_type`` has no tiny config.

    Examples
    --------
    >>> from npattn.models import CausalLM
    >>> from npattn.models.tiny import tiny_config
    >>> CausalLM(tiny_config("qwen3", num_hidden_layers=3), rng=0).config.layer_types
    ('full_attention', 'sliding_attention', 'sliding_attention')
    """
    if model_type not in TINY_CONFIGS:
        raise ValueError(f"model_type: expected one of {list(TINY_CONFIGS)}, got {model_type!r}")
    return dict(copy.deepcopy(TINY_CONFIGS[model_type]), **changes)


# the keys that are widths (features of a head, a projection or an expert): they grow with hidden_size
_WIDTHS = (
    "hidden_size",
    "intermediate_size",
    "n_inner",  # GPT-2's
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "head_dim",
    "query_pre_attn_scalar",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "index_head_dim",
    "v_head_dim",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "global_head_dim",
    "hidden_size_per_layer_input",
    "mamba_d_head",
    "mamba_d_ssm",
)


def scaled_config(model_type: str, *, hidden: int, layers: int, vocab: int) -> dict:
    """``TINY_CONFIGS[model_type]``'s options at width ``hidden`` (a multiple of its 16), with
    ``layers`` layers (an explicit ``layer_types`` repeated) and a ``vocab``-token vocabulary:
    every width (``_WIDTHS``: heads' features, projections, experts) times ``hidden / 16``, head
    and expert counts, windows and the rest unchanged.

    Raises
    ------
    ValueError
        An unknown ``model_type`` or a ``hidden`` that is not a multiple of the tiny width.
    """
    d = tiny_config(model_type)
    base = d["hidden_size"]
    if not isinstance(hidden, int) or hidden < base or hidden % base:
        raise ValueError(f"hidden: expected a multiple of {base} (the tiny config's width), got {hidden!r}")
    for key in _WIDTHS:
        if key in d:
            d[key] *= hidden // base
    if "layer_types" in d:
        d["layer_types"] = (d["layer_types"] * math.ceil(layers / len(d["layer_types"])))[:layers]
    lac = d.get("linear_attn_config")
    if lac:  # Kimi Linear: the head width scaled, the 1-indexed layer lists' pattern repeated
        lac["head_dim"] *= hidden // base
        n = d["num_hidden_layers"]
        kda = [i % n + 1 in lac["kda_layers"] for i in range(layers)]
        lac["kda_layers"] = [i + 1 for i in range(layers) if kda[i]]
        lac["full_attn_layers"] = [i + 1 for i in range(layers) if not kda[i]]
    if "num_kv_shared_layers" in d:  # Gemma 4: the same share of reusing layers, each with a layer of
        lt = d["layer_types"][:-1] + ["full_attention"]  # its type before them (the last: full, as transformers)
        k = d["num_kv_shared_layers"] * layers // d["num_hidden_layers"]
        while k and not set(lt[layers - k :]) <= set(lt[: layers - k]):
            k -= 1
        d.update(num_kv_shared_layers=k, vocab_size_per_layer_input=vocab)
    rs = d.get("rope_scaling")
    if rs and rs.get("rope_type") == "longrope":  # Phi-3: one factor a rotated pair, each repeated
        k = hidden // base
        for key in ("short_factor", "long_factor"):
            rs[key] = [f for f in rs[key] for _ in range(k)]
    d.update(num_hidden_layers=layers, vocab_size=vocab)
    return d
