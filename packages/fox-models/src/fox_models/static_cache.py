"""A fixed-capacity decoding cache for the attention models (FoX and the Transformer), whose decoding step
is replayed as a CUDA graph.

``generate(..., cache_implementation="static")`` makes a ``StaticFoxCache`` of ``max_length - 1`` tokens
per row (and keeps it on the model for the next call of the same capacity). Each layer's K, V, gate prefix
sums, token-shift states and left padding live in buffers allocated once, at the prefill; every later
token is written in place at the row's length, which is a device tensor (``cache_seqlens``). So a
decoding step has fixed shapes, fixed addresses and no host synchronisation: on a GPU ``generate()``
compiles the step with ``torch.compile`` (unless ``disable_compile=True``), the model runs the first steps
without capture (they compile the kernels and the step), captures the next in a CUDA graph and replays
that graph for every later token (one launch instead of hundreds). The result equals the growing cache's
(``FoxCache``) token for token; the tests check it.

What a static cache cannot do: grow past its capacity (a clear error), change its batch size in the middle
of decoding, or roll back tokens of a model with a token shift (assisted decoding: use the default cache).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from fox_kernel import append_to_paged_cache, fill_empty_cache, gate_cache
from fox_models.cache import FoxCache, FoxCacheLayer


class StaticFoxCacheLayer(FoxCacheLayer):
    """One attention layer's state in buffers of ``capacity`` tokens per row, written in place.

    ``k``, ``v`` (B, capacity, Hkv, D), ``c`` (B, capacity, H) (head-major, ``fox_kernel.gate_cache``) and
    ``cache_seqlens`` (B,) int32 are what the kernel reads; ``length`` is the same count kept on the host (no
    sync to read it). ``k_shift``, ``v_shift`` and ``seq_start`` are buffers too, so a captured step reads
    the values of the step before.
    """

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._length = 0
        self._rows = None  # (B, 1) int32: the contiguous buffers as a paged cache of one page per row
        self._seq_start = None  # (B,) int32 buffer (zeros without left padding) once the prefill is written
        self._pending_seq_start = None  # the prefill's left padding, before the buffers hold it
        self._prefill_length = 0
        super().__init__()

    def __repr__(self):
        return f"{type(self).__name__}(length={self._length}, capacity={self.capacity})"

    @property
    def length(self) -> int:
        return self._length

    @property
    def seq_start(self):
        return self._pending_seq_start if self._length == 0 else self._seq_start

    @seq_start.setter
    def seq_start(self, value) -> None:
        if self._length:
            raise ValueError("a static cache takes its left padding at the prefill (an empty cache)")
        self._pending_seq_start = value

    def get_max_length(self) -> int:
        return self.capacity

    def _allocate(self, k, v, log_fgate, k_unmixed, v_unmixed) -> None:
        B, _, Hkv, D = k.shape
        self.k = k.new_zeros(B, self.capacity, Hkv, D)
        self.v = v.new_zeros(B, self.capacity, Hkv, D)
        # head-major: the decoding kernel reads each head's prefix sums as one run of memory
        self.c = gate_cache(B, self.capacity, log_fgate.shape[2], k.device)
        self.cache_seqlens = torch.zeros(B, dtype=torch.int32, device=k.device)
        self._seq_start = torch.zeros(B, dtype=torch.int32, device=k.device)
        self._rows = torch.arange(B, dtype=torch.int32, device=k.device)[:, None]
        self.k_shift = None if k_unmixed is None else k_unmixed.new_zeros(B, k_unmixed.shape[2])
        self.v_shift = None if v_unmixed is None else v_unmixed.new_zeros(B, v_unmixed.shape[2])

    def _fits(self, k, v_unmixed, k_unmixed) -> bool:
        """Whether the buffers (from an earlier generate() call) take this prefill's tensors."""
        return (self.k is not None and self.k.shape[0] == k.shape[0] and self.k.shape[2:] == k.shape[2:]
                and self.k.dtype == k.dtype and self.k.device == k.device
                and (self.k_shift is None) == (k_unmixed is None) and (self.v_shift is None) == (v_unmixed is None))

    def append(self, k, v, log_fgate, k_unmixed=None, v_unmixed=None) -> None:
        Tn = k.shape[1]
        if self.record_past:
            raise ValueError("a static cache does not record its past (assisted or prompt-lookup decoding): "
                             "use the default cache")
        if self._length + Tn > self.capacity:
            raise ValueError(f"the static cache holds {self.capacity} tokens per row; {self._length} cached + {Tn} "
                             f"new do not fit (generate()'s max_length sets the capacity)")
        if self._length == 0:
            if not self._fits(k, v_unmixed, k_unmixed):
                self._allocate(k, v, log_fgate, k_unmixed, v_unmixed)
            self.cache_seqlens.zero_()
            if self._pending_seq_start is None:
                self._seq_start.zero_()
            else:
                self._seq_start.copy_(self._pending_seq_start)
            self._pending_seq_start = None
            self._prefill_length = Tn
        elif k.shape[0] != self.k.shape[0]:
            raise ValueError(f"a static cache keeps its batch size {self.k.shape[0]}, got {k.shape[0]} rows")
        if self._length == 0:  # a prefill: every row starts at position 0
            lengths = fill_empty_cache(self.k, self.v, self.c, k, v, log_fgate, self._seq_start)
        else:
            lengths = append_to_paged_cache(self.k, self.v, self.c, self._rows, self.cache_seqlens, k, v, log_fgate,
                                            self._seq_start)
        self.cache_seqlens.copy_(lengths)
        for shift, unmixed in ((self.k_shift, k_unmixed), (self.v_shift, v_unmixed)):
            if unmixed is not None:
                shift.copy_(unmixed[:, -1])
        self._length += Tn

    @property
    def can_truncate(self) -> bool:
        return self.k_shift is None and self.v_shift is None

    def truncate(self, length: int) -> None:
        if length < 0:
            raise ValueError(f"length must be >= 0, got {length}")
        if length >= self._length:
            return
        if not self.can_truncate:
            raise ValueError("a static cache of a model with a token shift cannot roll back tokens: use the "
                             "default cache")
        self._length = length
        self.cache_seqlens.fill_(length)

    def reset(self) -> None:
        """Empty the cache; the buffers stay for the next prompt of the same shape."""
        self._length = 0
        self._pending_seq_start = None
        if self.cache_seqlens is not None:  # the next prefill's RoPE positions start from these
            self.cache_seqlens.zero_()
        for shift in (self.k_shift, self.v_shift):  # the token before the next prompt's first: none
            if shift is not None:
                shift.zero_()

    def reorder(self, index: torch.Tensor) -> None:
        """Select batch rows (beam search), in place: the buffers keep their addresses."""
        for t in (self.k, self.v, self.c, self.k_shift, self.v_shift, self._seq_start, self.cache_seqlens):
            if t is not None:
                t.copy_(t.index_select(0, index.to(t.device)))

    def repeat_interleave(self, repeats: int) -> None:
        if self._length:
            raise ValueError("a static cache keeps its batch size: repeat the inputs before the prefill")

    def _map(self, fn) -> None:
        raise ValueError("a static cache keeps its batch size and device (select, offload): use the default cache")


class StaticFoxCache(FoxCache):
    """``num_layers`` ``StaticFoxCacheLayer`` of ``capacity`` tokens, and the CUDA graph of the decoding
    step that runs over them (``decode``)."""

    def __init__(self, num_layers: int, capacity: int):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        Cache.__init__(self, layers=[StaticFoxCacheLayer(capacity) for _ in range(num_layers)])
        self.capacity = capacity
        self.graphs = True
        """Replay decoding steps as a CUDA graph (on a GPU); False runs every step eagerly."""
        self.compile_config = None
        """transformers' ``CompileConfig`` of the decoding step that is captured, or None (not compiled):
        ``generate()`` sets it (see ``FoxPreTrainedModel._valid_auto_compile_criteria``)."""
        self._graph = None
        self._warm_key = None
        self._warm_steps = 0

    def _key(self):
        """What a captured step depends on besides the buffers' contents: their addresses, the prompt
        length (the token shift's padding test takes the step's position as a number) and how the step is
        compiled."""
        first = self.layers[0]
        return (first._prefill_length, tuple(layer.k.data_ptr() for layer in self.layers), repr(self.compile_config))

    def can_replay(self, input_ids) -> bool:
        """Whether ``decode`` takes this step: a CUDA cache holding a prompt, one new token per row."""
        first = self.layers[0]
        return (self.graphs and first.k is not None and first.k.is_cuda and first.length > 0
                and input_ids is not None and input_ids.dim() == 2 and input_ids.shape[1] == 1)

    def decode(self, step, input_ids: torch.Tensor) -> torch.Tensor:
        """``step(input_ids)`` (the model's logits for one new token per row, appending it to this cache),
        replayed from a CUDA graph: the first steps of a prompt shape run without capture on a side stream
        (they compile the kernels, or the whole step under ``torch.compile``, and set up cuBLAS), the next
        is captured, later ones replay. One such step, or two for a compiled step (``compile_config``): its
        second call recompiles with the decoding position as a symbol, and nothing may compile while
        capturing."""
        warm_steps = 1 if self.compile_config is None else 2
        for layer in self.layers:
            if layer.length + 1 > layer.capacity:
                raise ValueError(f"the static cache holds {layer.capacity} tokens per row and is full "
                                 "(generate()'s max_length sets the capacity)")
        key = self._key()
        if self._graph is None or self._graph[0] != key:
            self._graph = None
            if self._warm_key != key:
                self._warm_key, self._warm_steps = key, 0
            if self._warm_steps < warm_steps:
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    logits = step(input_ids)
                torch.cuda.current_stream().wait_stream(stream)
                self._warm_steps += 1
                return logits
            static_ids = input_ids.clone()
            lengths = [layer._length for layer in self.layers]
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_logits = step(static_ids)
            for layer, n in zip(self.layers, lengths):  # capturing ran the Python, not the kernels
                layer._length = n
            self._graph = (key, graph, static_ids, static_logits)
        _, graph, static_ids, static_logits = self._graph
        static_ids.copy_(input_ids)
        graph.replay()
        for layer in self.layers:
            layer._length += 1
        return static_logits.clone()
