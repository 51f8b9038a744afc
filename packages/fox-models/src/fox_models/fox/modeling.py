"""Hugging Face models of FoX in the layout of the published checkpoints
(``zhixuan-lin/*-longcrawl64-48b``)."""

from __future__ import annotations

from torch import nn

from fox_layers import ForgettingAttentionLayer, RMSNorm, SwiGLUMLP
from fox_models.base import _FoxForCausalLMBase, _FoxPreTrainedBase
from fox_models.cache import FoxCache
from fox_models.compat import GenerationMixin, GradientCheckpointingLayer, pick_cache
from fox_models.fox.configuration import ForgettingTransformerConfig


class FoxBlock(GradientCheckpointingLayer):
    """Pre-norm block: x + attn(attn_norm(x)), then + mlp(mlp_norm(x)). Checkpointed as a whole when the
    model's ``gradient_checkpointing_enable()`` is on (transformers' ``GradientCheckpointingLayer``)."""

    def __init__(self, config, attention_cls):
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.attn = attention_cls(config.hidden_size, **config.attention_kwargs())
        self.mlp_norm = RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.mlp = SwiGLUMLP(config.hidden_size, config.hidden_ratio, config.intermediate_size)

    def forward(self, x, seq_start=None, cu_seqlens=None, state=None, output_attentions=False):
        """-> x, or (x, attention weights (B, H, T, T_keys)) with ``output_attentions``."""
        a, _, *weights = self.attn(self.attn_norm(x), seq_start=seq_start, cu_seqlens=cu_seqlens, state=state,
                                   output_attentions=output_attentions)
        x = x + a
        x = x + self.mlp(self.mlp_norm(x))
        return (x, weights[0]) if output_attentions else x


class _FoxBackbone(_FoxPreTrainedBase):
    """Embeddings, ``FoxBlock``s around ``attention_cls``, final RMSNorm: FoX's and the Transformer's layout."""

    attention_cls = ForgettingAttentionLayer

    def __init__(self, config):
        super().__init__(config)
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([FoxBlock(config, self.attention_cls) for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.gradient_checkpointing = False
        self.post_init()

    def new_cache(self):
        return FoxCache(len(self.layers))

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        cache: FoxCache | None = None,
        inputs_embeds=None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        cu_seqlens=None,
        return_dict: bool | None = None,
        past_key_values: FoxCache | None = None,
        **kwargs,
    ):
        """``output_attentions=True``: every layer's attention weights (B, H, T, T_keys), computed explicitly
        (float32 softmax of s q.k + c_i - c_j with the causal and padding masks; slow, O(T^2) memory).
        ``past_key_values`` is the older name of ``cache``."""
        x, cache, _, seq_start, use_cache, output_hidden_states, order = self._start(
            input_ids, inputs_embeds, attention_mask, pick_cache(cache, past_key_values), use_cache,
            output_hidden_states)
        if output_attentions is None:
            output_attentions = self.config.output_attentions
        x, hidden, weights = self._run_blocks(x, cache, output_hidden_states, lambda i: (seq_start, cu_seqlens),
                                              output_attentions)
        out = self._finish(x, hidden, cache, use_cache, weights, order)
        return_dict = return_dict if return_dict is not None else getattr(self.config, "return_dict", True)
        return out if return_dict else out.to_tuple()


class ForgettingTransformerPreTrainedModel(_FoxPreTrainedBase):
    config_class = ForgettingTransformerConfig


class ForgettingTransformerModel(_FoxBackbone):
    config_class = ForgettingTransformerConfig


class ForgettingTransformerForCausalLM(_FoxForCausalLMBase, GenerationMixin):
    config_class = ForgettingTransformerConfig
    backbone_cls = ForgettingTransformerModel
