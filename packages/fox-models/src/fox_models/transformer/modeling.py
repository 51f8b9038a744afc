"""Hugging Face models of the Transformer (LLaMA) baseline: FoX's blocks with plain RoPE attention."""

from __future__ import annotations

import torch.nn.functional as F

from fox_layers import ForgettingAttentionLayer
from fox_models.base import _FoxForCausalLMBase
from fox_models.compat import GenerationMixin
from fox_models.fox.modeling import _FoxBackbone
from fox_models.transformer.configuration import TransformerConfig


class TransformerAttention(ForgettingAttentionLayer):
    """Plain RoPE attention. Without padding, packing, a cache or a sliding window it runs SDPA (cuDNN/flash
    on GPU); otherwise the FoX kernel with gates of 1, which is the same function (also under context
    parallelism, whose kernel call is the layer's ``attention_kernel``), and which applies the window."""

    # One matmul per projection: with RoPE and SDPA, the fused q/k/v matmul was slower (the RoPE backward
    # writes its gradients transposed into the shared buffer): 125M, 16k, compiled, H200, 66.5 ms a step
    # with separate projections against 67.7-68.2 ms fused.
    fuse_input_projections = False

    def forward(self, hidden_states, *, seq_start=None, cu_seqlens=None, state=None, output_attentions=False):
        if (seq_start is not None or cu_seqlens is not None or state is not None or output_attentions
                or self.context_parallel is not None or self.window_size is not None):
            return super().forward(hidden_states, seq_start=seq_start, cu_seqlens=cu_seqlens, state=state,
                                   output_attentions=output_attentions)
        B, T, _ = hidden_states.shape
        q, k, v, _, _, _ = self.project(hidden_states)
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
            enable_gqa=self.num_kv_heads != self.num_heads,
        ).transpose(1, 2)
        return self.o_proj(o.reshape(B, T, self.hidden_size)), None


class TransformerModel(_FoxBackbone):
    config_class = TransformerConfig
    attention_cls = TransformerAttention


class TransformerForCausalLM(_FoxForCausalLMBase, GenerationMixin):
    config_class = TransformerConfig
    backbone_cls = TransformerModel
