"""What every model of the package shares: the pre-trained model and causal-LM classes (HF ``PreTrainedModel``)
that embed the tokens, run ``layers`` of blocks with or without a cache, apply the final norm, score the
loss and plug into ``generate()``; each family (``fox_models.fox``, ``fox_models.mamba2``...) subclasses
them with its config, blocks and backbone."""

from __future__ import annotations

import functools
import json
import os

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers import initialization as init
from transformers.generation.configuration_utils import CompileConfig
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from fox_kernel import values_checkable
from fox_layers import ForgettingAttentionLayer, GroupRMSNorm, RMSNorm, bare_linear, decay_time_bias
from fox_models import hub
from fox_models.cache import FoxCache, LayerCache
from fox_models.compat import (
    CACHE_KWARG,
    GenerationMixin,
    cache_field,
    get_cache,
    normalize_cache_kwargs,
    output_cache,
    pick_cache,
    set_cache,
)
from fox_models.loss import IGNORE_INDEX, per_token_cross_entropy
from fox_models.static_cache import StaticFoxCache


def seq_start_from_mask(attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """(B, T) 0/1 mask -> (B,) index of the first real token, or None without left padding.

    Each row must be one run of ones: left padding (zeros first), right padding (zeros last) or both.
    Causal attention never lets a real token see the right padding after it, so only the left padding
    needs the kernel's ``seq_start``; the outputs at right-padding positions are meaningless, as in
    every decoder-only model, and their labels should be -100."""
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2:
        raise ValueError(f"attention_mask must be 2-D (B, T), got shape {tuple(attention_mask.shape)}")
    mask = attention_mask.bool()
    T = mask.shape[1]
    pos = torch.arange(T, device=mask.device)[None, :]
    seq_start = torch.where(mask, pos, T).amin(-1).clamp_max(T - 1)  # an all-padding row: start at the end
    if torch.compiler.is_compiling():
        # torch.export / torch.compile: no check of or branch on the mask's values (each would be a graph
        # break or an export error); a seq_start of zeros is the unpadded function, so it is always passed
        return seq_start
    seq_end = torch.where(mask, pos + 1, 0).amax(-1)
    expected = (pos >= seq_start[:, None]) & (pos < seq_end[:, None])
    if not torch.equal(mask, expected):
        raise ValueError(
            "attention_mask must be padding: one run of ones per row, with zeros only before it (left padding) "
            "or after it (right padding); masks with holes (e.g. packed documents) are not supported, use cu_seqlens"
        )
    return None if int(seq_start.max()) == 0 else seq_start


def padding_layout(attention_mask: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(B, T) 0/1 mask -> (seq_start, order): how the backbone reads a 2-D mask.

    A mask of one run of ones per row (left, right or both sides padded) gives its left padding
    (``seq_start_from_mask``) and ``order=None``. Any other mask (zeros between ones, "holes") gives the
    (B, T) permutation ``order`` that moves each row's masked tokens in front of its kept ones, both in their
    order, and the ``seq_start`` of that left-padded row: the backbone runs the rows so permuted, so a masked token is neither attended to nor
    decays the kept ones (no forget gate, no token shift, no recurrent update of it), and the kept tokens get
    the outputs of the row without the masked ones. Under torch.compile the mask is read as padding only."""
    if attention_mask is None or attention_mask.dim() != 2 or torch.compiler.is_compiling():
        return seq_start_from_mask(attention_mask), None
    mask = attention_mask.bool()
    T = mask.shape[1]
    pos = torch.arange(T, device=mask.device)[None, :]
    seq_start = torch.where(mask, pos, T).amin(-1)
    seq_end = torch.where(mask, pos + 1, 0).amax(-1)
    if torch.equal(mask, (pos >= seq_start[:, None]) & (pos < seq_end[:, None])):
        seq_start = seq_start.clamp_max(T - 1)  # an all-padding row: start at the end
        return (None if int(seq_start.max()) == 0 else seq_start), None
    order = torch.argsort(mask.to(torch.int8), dim=1, stable=True)
    return (T - mask.sum(-1)).clamp_max(T - 1), order


def permute_tokens(x: torch.Tensor, order: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """x (B, T, ...) with row b's tokens taken in ``order[b]`` (or put back from that order: ``inverse``)."""
    index = torch.argsort(order, dim=1) if inverse else order
    return x.gather(1, index.view(*index.shape, *[1] * (x.dim() - 2)).expand(-1, -1, *x.shape[2:]))


def check_attention_mask(attention_mask: torch.Tensor, batch: int, past: int, new: int) -> None:
    """A one-line ValueError unless ``attention_mask`` is (B, cached + new tokens), the 2-D padding mask that
    the model reads (a shorter or longer mask would pad other tokens than the caller meant)."""
    expected = (batch, past + new)
    if attention_mask.dim() != 2 or tuple(attention_mask.shape) != expected:
        where = f"{past} cached + {new} new tokens" if past else f"{new} tokens"
        raise ValueError(f"attention_mask must have shape {expected} (batch, {where}), got "
                         f"{tuple(attention_mask.shape)}")


TOKEN_ID_DTYPES = (torch.int64, torch.int32)  # the index types nn.Embedding takes


def check_input_ids(input_ids, vocab_size: int) -> None:
    """A one-line error unless ``input_ids`` is a (B, T) tensor of token ids (int64 or int32) in
    [0, vocab_size). The type, rank and dtype are always checked (tensor metadata); the values only where
    reading them costs no wait for a device (CPU tensors, outside tracing: ``values_checkable``). On CUDA the
    embedding's own bounds check reports a bad id."""
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"input_ids must be a torch.Tensor of token ids, got {type(input_ids).__name__}")
    if input_ids.dtype not in TOKEN_ID_DTYPES:
        raise TypeError(f"input_ids must be token ids of dtype torch.int64 or torch.int32, got {input_ids.dtype}")
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be 2-D (batch, tokens), got shape {tuple(input_ids.shape)}")
    if input_ids.numel() and values_checkable(input_ids):
        lo, hi = int(input_ids.min()), int(input_ids.max())
        if lo < 0 or hi >= vocab_size:
            raise ValueError(f"input_ids must lie in [0, vocab_size) = [0, {vocab_size}), got values in [{lo}, {hi}]")


def check_inputs_embeds(inputs_embeds, hidden_size: int) -> None:
    """A one-line ValueError unless ``inputs_embeds`` is a (B, T, hidden_size) tensor (metadata only)."""
    if not isinstance(inputs_embeds, torch.Tensor):
        raise TypeError(f"inputs_embeds must be a torch.Tensor, got {type(inputs_embeds).__name__}")
    if inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != hidden_size:
        raise ValueError(f"inputs_embeds must have shape (batch, tokens, hidden_size={hidden_size}), got "
                         f"{tuple(inputs_embeds.shape)}")


class _FoxPreTrainedBase(PreTrainedModel):
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["FoxBlock"]  # FoX's and the Transformer's; the recurrent families name theirs
    _supports_sdpa = True

    def get_input_embeddings(self):  # backbones; the LM classes override both
        return self.embeddings

    def set_input_embeddings(self, value):
        self.embeddings = value

    def enable_projection_recompute(self, enabled: bool = True) -> int:
        """Selective activation recomputation for training: every Forgetting Attention layer keeps only
        its input and the attention's q/k/v/output, and recomputes its projections, token shift, QK-norm
        and output norm/gate/projection in the backward (less memory than the full block checkpointing of
        ``gradient_checkpointing_enable``, a few extra GEMMs). Returns the number of layers switched."""
        from fox_layers import ForgettingAttentionLayer

        layers = [m for m in self.modules() if isinstance(m, ForgettingAttentionLayer)]
        for layer in layers:
            layer.recompute_projections = enabled
        return len(layers)

    # The backbones' forward in three parts, shared by FoX, the Transformer and the recurrent baselines.
    def _start(self, input_ids, inputs_embeds, attention_mask, cache, use_cache, output_hidden_states):
        """-> (embedded x, cache or None, cached length, seq_start (left padding) or None, use_cache,
        output_hidden_states, order). ``order`` is None, or for a mask with holes the permutation that
        ``padding_layout`` gives: x is then permuted into it, and ``_finish`` puts the outputs back."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        if inputs_embeds is None:
            # the embedding's size, which resize_token_embeddings keeps in step with config.vocab_size
            check_input_ids(input_ids, getattr(self.embeddings, "num_embeddings", self.config.vocab_size))
            x = self.embeddings(input_ids)
        else:
            check_inputs_embeds(inputs_embeds, self.config.hidden_size)
            x = inputs_embeds
        output_hidden_states = output_hidden_states if output_hidden_states is not None else self.config.output_hidden_states
        use_cache = use_cache if use_cache is not None else (self.config.use_cache and not self.training)
        if cache is not None and not isinstance(cache, LayerCache):
            raise TypeError(f"{CACHE_KWARG} must be this model's cache ({type(self.new_cache()).__name__}, from "
                            f"model.new_cache()), got {type(cache).__name__}")
        if use_cache and cache is None:
            cache = self.new_cache()
        past = 0 if cache is None else cache.get_seq_length()
        seq_start = order = None
        if attention_mask is not None:
            check_attention_mask(attention_mask, x.shape[0], past, x.shape[1])
            # with a cache the padding was read at the prefill and lives in the cache's states; generate()
            # appends ones after right-padded prompts, so later masks need not be one run of ones
            if past == 0:
                seq_start, order = padding_layout(attention_mask)
                if order is not None:
                    x = permute_tokens(x, order)
        return x, cache, past, seq_start, use_cache, output_hidden_states, order

    def _run_blocks(self, x, cache, output_hidden_states, extra, output_attentions=False):
        """x through ``self.layers``; block i is called ``block(x, *extra(i), state_i)`` (and
        ``output_attentions=True``, when asked, returning (x, weights)). -> (x, hidden states, weights)."""
        hidden = [] if output_hidden_states else None
        weights = [] if output_attentions else None
        for i, block in enumerate(self.layers):
            if hidden is not None:
                hidden.append(x)
            args = (x, *extra(i), None if cache is None else cache.layers[i])
            # each block is a GradientCheckpointingLayer: it checkpoints itself once gradient_checkpointing_enable()
            # has switched it on
            x = block(*args, output_attentions=True) if output_attentions else block(*args)
            if weights is not None:
                x, w = x
                weights.append(w)
        return x, hidden, weights

    def final_norm(self, x):
        return self.norm(x)

    def _finish(self, x, hidden, cache, use_cache, weights=None, order=None):
        x = self.final_norm(x)
        if hidden is not None:
            hidden.append(x)
        if order is not None:  # the tokens back in the input's order (``padding_layout``)
            x = permute_tokens(x, order, inverse=True)
            if hidden is not None:
                hidden = [permute_tokens(h, order, inverse=True) for h in hidden]
            if weights is not None:  # (B, H, T, T): queries and keys
                inv = torch.argsort(order, dim=1)
                rows = torch.arange(inv.shape[0], device=inv.device)[:, None, None]
                weights = [w[rows, :, inv[:, :, None], inv[:, None, :]].permute(0, 3, 1, 2) for w in weights]
        return BaseModelOutputWithPast(last_hidden_state=x, **cache_field(cache if use_cache else None),
                                       hidden_states=tuple(hidden) if hidden is not None else None,
                                       attentions=tuple(weights) if weights is not None else None)

    def save_pretrained(self, save_directory, *args, **kwargs):
        """transformers' save_pretrained, plus what loads the folder without importing fox_models first:
        ``auto_map`` in config.json and the small module it names (see ``fox_models.hub``)."""
        self.config.auto_map = hub.auto_map(self.config)
        super().save_pretrained(save_directory, *args, **kwargs)
        hub.write_remote_module(save_directory)

    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                init.zeros_(module.bias)
                times = getattr(module, "decay_times", None)  # a full forget gate's decay-time bias init
                if times is not None:
                    init.copy_(module.bias, decay_time_bias(module.out_features, *times))
        elif isinstance(module, nn.Embedding):
            init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, (RMSNorm, GroupRMSNorm)) and module.weight is not None:
            init.ones_(module.weight)
        if isinstance(module, ForgettingAttentionLayer):
            module.reset_fgate_bias(copy_=init.copy_)


class _FoxForCausalLMBase(_FoxPreTrainedBase, GenerationMixin):
    # Each family's LM class also names GenerationMixin among its own bases, as transformers' models do:
    # can_generate() and transformers' test_inherits_generation_mixin look at a class's direct bases.
    backbone_cls: type[_FoxPreTrainedBase]  # the family's backbone (AutoModel) class
    _tied_weights_keys = {"lm_head.weight": "model.embeddings.weight"}  # with config.tie_word_embeddings only

    def __init__(self, config):
        super().__init__(config)
        # the backbone lives under base_model_prefix: ``model``, or the name a family's checkpoints use
        setattr(self, self.base_model_prefix, self.backbone_cls(config))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embeddings

    def set_input_embeddings(self, value):
        self.model.embeddings = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the cache is the model's own (new_cache), made in _prepare_cache_for_generation

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        """``generate()`` makes a ``DynamicCache`` for most models; these models need their own cache, put in
        ``model_kwargs`` under the name this transformers release's generation loop reads (``CACHE_KWARG``)."""
        normalize_cache_kwargs(model_kwargs)
        cache = get_cache(model_kwargs)
        if cache is not None:
            if not isinstance(cache, LayerCache):
                raise TypeError(f"{CACHE_KWARG} must be this model's cache ({type(self.model.new_cache()).__name__}, "
                                f"from model.model.new_cache()), got {type(cache).__name__}")
            return super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)
        if generation_config.use_cache is False:
            return
        if generation_config.cache_implementation == "static":
            max_cache_length = kwargs.get("max_cache_length", args[-1] if args else generation_config.max_length - 1)
            set_cache(model_kwargs, self.static_cache(max_cache_length))
            return
        if generation_config.cache_implementation not in (None, "dynamic"):
            raise ValueError(f"cache_implementation={generation_config.cache_implementation!r} is not supported: "
                             "these models decode with their own growing cache, or a static one (\"static\")")
        cache = self.model.new_cache()
        if generation_config.is_assistant:  # an assistant's cache is rolled back after each round
            cache.activate_past_recording()
        set_cache(model_kwargs, cache)

    def static_cache(self, capacity: int) -> StaticFoxCache:
        """An empty ``StaticFoxCache`` of ``capacity`` tokens per row (``generate(...,
        cache_implementation="static")`` asks for one of ``max_length - 1``). The model keeps the last one
        and hands it out again, emptied, for the same capacity: its buffers and its captured decoding step
        are reused by the next generate() call of the same shape."""
        own = type(self.model.new_cache())
        if own is not FoxCache:
            raise ValueError(f"a static cache is for the attention models (FoX, the Transformer); "
                             f"{type(self).__name__} decodes with {own.__name__}")
        cache = self.__dict__.get("_static_cache")
        if cache is None or cache.capacity != capacity or len(cache.layers) != len(self.model.layers):
            cache = StaticFoxCache(len(self.model.layers), capacity)
            self.__dict__["_static_cache"] = cache
        cache.reset()
        return cache

    def _prepare_model_inputs(self, *args, **kwargs):
        """transformers' choice of the prompt tensor, and checks that it holds a token and that
        ``attention_mask`` covers it: generate() drops a mask of ones before the model sees it, so a mask of
        the wrong length would pass unnoticed. An empty prompt gives no logits to draw the first token from
        (the forward of 0 tokens returns (B, 0, V)), so generate() refuses it in one line."""
        inputs, input_name, model_kwargs = super()._prepare_model_inputs(*args, **kwargs)
        if isinstance(inputs, torch.Tensor) and input_name in ("input_ids", "inputs_embeds") and inputs.dim() >= 2 \
                and inputs.shape[1] == 0:
            raise ValueError(f"{input_name} must hold at least one token per row for generate(), got shape "
                             f"{tuple(inputs.shape)} (start the prompt with the BOS token, bos_token_id="
                             f"{self.generation_config.bos_token_id})")
        mask = model_kwargs.get("attention_mask")
        if mask is not None and inputs is not None and input_name in ("input_ids", "inputs_embeds"):
            check_attention_mask(mask, inputs.shape[0], 0, inputs.shape[1])
        return inputs, input_name, model_kwargs

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, inputs_embeds=None, **kwargs):
        """transformers' preparation (the new tokens, or the prompt's embeddings at the first step; every
        other keyword forwarded), with this model's cache under ``CACHE_KWARG`` (a new one when none is
        given and ``use_cache`` is on); positions are not needed. ``inputs_embeds`` is in the signature:
        generate() looks for it there before it takes a prompt of embeddings."""
        normalize_cache_kwargs(kwargs)
        if kwargs.get("use_cache", True) and get_cache(kwargs) is None:
            set_cache(kwargs, self.model.new_cache())
        kwargs.setdefault("use_cache", True)
        kwargs.pop("position_ids", None)
        return super().prepare_inputs_for_generation(input_ids, attention_mask=attention_mask,
                                                     inputs_embeds=inputs_embeds, **kwargs)

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        cache: FoxCache | None = None,
        inputs_embeds=None,
        labels=None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        cu_seqlens=None,
        return_dict: bool | None = None,
        logits_to_keep: int = 0,
        per_token_loss: bool = False,
        num_items_in_batch=None,
        past_key_values: FoxCache | None = None,
        shift_labels=None,
        **kwargs,
    ):
        """Hugging Face's causal-LM call. ``labels`` (B, T) are the input ids: the model shifts them (the
        output at t is scored against label t + 1), ignores -100 and returns the mean loss over the scored
        tokens (the sum over ``num_items_in_batch`` when the Trainer passes it), with the logits.
        ``shift_labels`` (B, T), as transformers' losses take them, are targets already aligned with the
        outputs (the output at t is scored against ``shift_labels[:, t]``) and replace ``labels``: sequence
        and context parallel training shift the whole sequence before sharding it and pass them.

        ``per_token_loss=True`` is the paper's convention (fox-train, fox-eval's per-token loss, the
        published checkpoints' numbers): the caller has shifted (``input_ids = [BOS] + labels[:-1]``), the
        output at t is scored against label t, and the loss is per token, (B, T) float32 (0 where a label
        is -100), with ``logits=None`` (no (B, T, V) tensor at long context).

        ``cache`` is this model's cache (``model.model.new_cache()``, or a ``StaticFoxCache``);
        ``past_key_values`` is its older name, accepted too.

        ``position_ids`` are accepted and not used: FoX has no positions, and the Transformer's RoPE
        positions follow from the padding and the cache (the default position ids).

        With a ``StaticFoxCache`` on a GPU, a decoding step (one new token per row, no labels, no extra
        outputs) is replayed as a CUDA graph (``StaticFoxCache.decode``); it returns only the logits and
        the cache."""
        cache = pick_cache(cache, past_key_values)
        if cu_seqlens is not None and use_cache is None and cache is None:
            use_cache = False  # packed sequences are a training or scoring batch: no cache unless asked for one
        if isinstance(cache, StaticFoxCache):
            if output_attentions:
                raise ValueError("output_attentions needs the default cache (a static cache's buffers are longer "
                                 "than the tokens they hold)")
            if (cache.can_replay(input_ids) and labels is None and inputs_embeds is None and not output_hidden_states
                    and cu_seqlens is None and not torch.is_grad_enabled() and not torch.compiler.is_compiling()):
                # the replayed graph copies the ids into its int64 buffer: a float tensor would be cast silently
                check_input_ids(input_ids, getattr(self.get_input_embeddings(), "num_embeddings", self.config.vocab_size))
                step = self._decode_step if cache.compile_config is None else self._compiled_decode_step(cache.compile_config)
                logits = cache.decode(functools.partial(step, cache=cache), input_ids)
                output = CausalLMOutputWithPast(logits=logits, **cache_field(cache))
                return output if return_dict is not False else output.to_tuple()
        out = self.model(
            # the older name of the cache keyword: every backbone takes it
            input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache,
            inputs_embeds=inputs_embeds, use_cache=use_cache, output_hidden_states=output_hidden_states,
            output_attentions=output_attentions, cu_seqlens=cu_seqlens, return_dict=True,
        )
        h = out.last_hidden_state
        loss = logits = None
        for name, given in (("labels", labels), ("shift_labels", shift_labels)):
            if given is not None and given.shape != h.shape[:2]:
                raise ValueError(f"{name} must have shape {tuple(h.shape[:2])} (B, T), got {tuple(given.shape)}")
        # config.fuse_cross_entropy=False keeps the unfused (float32 log-softmax) loss everywhere
        fused = None if getattr(self.config, "fuse_cross_entropy", True) else False
        if per_token_loss and (labels is not None or shift_labels is not None):
            loss = self._per_token_loss(h, shift_labels if shift_labels is not None else labels, fused)
        else:
            # an int keeps the last that many positions (0: all); a 1-D tensor holds the positions to keep
            # (transformers' two forms)
            if isinstance(logits_to_keep, torch.Tensor):
                kept = h[:, logits_to_keep]
            else:
                kept = h[:, -logits_to_keep:] if logits_to_keep else h
            logits = self.lm_head(kept)
            if shift_labels is not None or labels is not None:
                # the hidden states scored and their targets
                scored, targets = (h, shift_labels) if shift_labels is not None else (h[:, :-1], labels[:, 1:])
                per_token = self._per_token_loss(scored, targets, fused)
                count = num_items_in_batch if num_items_in_batch is not None else (targets != IGNORE_INDEX).sum()
                loss = per_token.sum() / count
        output = CausalLMOutputWithPast(loss=loss, logits=logits, **cache_field(output_cache(out)),
                                        hidden_states=out.hidden_states, attentions=out.attentions)
        return_dict = return_dict if return_dict is not None else getattr(self.config, "return_dict", True)
        return output if return_dict else output.to_tuple()

    def _per_token_loss(self, h, labels, fused):
        """Per-token cross-entropy (B, T) float32 of hidden states h (B, T, D) against labels (B, T). A bare
        lm_head's weight goes to the chunked loss; a wrapped one (PEFT/LoRA, hooks) is called as a module,
        so what it adds is in the loss."""
        if bare_linear(self.lm_head):
            return per_token_cross_entropy(h, self.lm_head.weight, labels, fused=fused)
        logits = self.lm_head(h).float()
        return F.cross_entropy(logits.transpose(1, 2), labels, reduction="none", ignore_index=IGNORE_INDEX)

    def _decode_step(self, input_ids, cache):
        """The logits (B, 1, V) of one new token per row, appended to ``cache`` (what a CUDA graph captures)."""
        h = self.model(input_ids=input_ids, past_key_values=cache, use_cache=True, return_dict=True).last_hidden_state
        return self.lm_head(h)

    def _compiled_decode_step(self, compile_config):
        """``_decode_step`` under ``torch.compile`` with ``compile_config``'s backend, fullgraph and options
        (kept per config). Its mode is not used, as the static cache captures the CUDA graph itself, and
        shapes are dynamic where they change (``dynamic=None``): the decoding position is a symbol, so a
        new prompt length does not compile again."""
        compiled = self.__dict__.setdefault("_compiled_decode_steps", {})
        key = repr(compile_config)
        if key not in compiled:  # the function, not the bound method: the model holds no cycle through it
            compiled[key] = torch.compile(type(self)._decode_step, backend=compile_config.backend,
                                          fullgraph=compile_config.fullgraph, dynamic=None,
                                          options=compile_config.options)
        return functools.partial(compiled[key], self)

    def _valid_auto_compile_criteria(self, model_kwargs, generation_config) -> bool:
        """transformers compiles the whole forward for a compileable cache. These models compile instead the
        decoding step of a ``StaticFoxCache`` on a GPU (fusing its small operations before the step is
        captured as a CUDA graph), with ``generation_config.compile_config`` (default: transformers'
        ``CompileConfig()``); ``generation_config.disable_compile=True`` keeps it eager."""
        cache = get_cache(model_kwargs)
        if isinstance(cache, StaticFoxCache):
            compile_ok = not generation_config.disable_compile and self.device.type == "cuda"
            cache.compile_config = (generation_config.compile_config or CompileConfig()) if compile_ok else None
            return False
        return super()._valid_auto_compile_criteria(model_kwargs, generation_config)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        config = kwargs.get("config")
        if config is None:
            config = cls.config_class.from_pretrained(pretrained_model_name_or_path, **_hub_kwargs(kwargs))
        if getattr(config, "qk_norm", False) is True and config.qk_norm_share_param_across_head is None:
            config.qk_norm_share_param_across_head = _qk_norm_is_shared(pretrained_model_name_or_path, config, kwargs)
        kwargs["config"] = config
        return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)


def _hub_kwargs(kwargs):
    keys = ("cache_dir", "force_download", "local_files_only", "token", "revision", "subfolder")
    return {k: kwargs[k] for k in keys if k in kwargs}


def _qk_norm_is_shared(path, config, kwargs) -> bool:
    """Released configs lack the flag: a (head_dim,) ``q_norm.weight`` means one weight shared by heads.
    Weights given as a ``state_dict`` (with or without a path) are read there, never looked up on disk or
    the Hub."""
    from safetensors import safe_open
    from transformers.utils import cached_file

    name = "model.layers.0.attn.q_norm.weight"
    head_dim = config.hidden_size // config.num_heads
    state_dict = kwargs.get("state_dict")
    if state_dict is not None or path is None:
        weight = (state_dict or {}).get(name)
        return weight is not None and list(weight.shape) == [head_dim]
    hub = _hub_kwargs(kwargs)
    index = cached_file(path, "model.safetensors.index.json", _raise_exceptions_for_missing_entries=False, **hub)
    filename = "model.safetensors"
    if index is not None:
        with open(index) as f:
            filename = json.load(f)["weight_map"].get(name, filename)
    file = cached_file(path, filename, _raise_exceptions_for_missing_entries=False, **hub)
    if file is None or not os.path.exists(file):
        return False
    with safe_open(file, framework="pt") as f:
        if name not in f.keys():  # noqa: SIM118 (safe_open is not a dict)
            return False
        shape = f.get_slice(name).get_shape()
    return list(shape) == [head_dim]


