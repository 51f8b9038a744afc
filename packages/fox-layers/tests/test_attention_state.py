"""AttentionState as a rollback-able cache (truncate after recording the past, batch row operations) and
the layer's explicit attention path (output_attentions), on the CPU in float64."""

import pytest
import torch

from fox_layers import AttentionState, ForgettingAttentionLayer

HIDDEN = 48
PRO = dict(num_heads=4, num_kv_heads=2, qk_norm=True, use_output_gate=True, use_output_norm=True, use_k_shift=True,
           use_v_shift=True)
LLAMA = dict(num_heads=4)


def _layer(kw, seed=0):
    torch.manual_seed(seed)
    return ForgettingAttentionLayer(HIDDEN, **kw).double()


def _x(B, T, seed=1):
    return torch.randn(B, T, HIDDEN, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _fields(state):
    return {n: getattr(state, n) for n in ("k", "v", "c", "k_shift", "v_shift", "seq_start")}


@pytest.mark.parametrize("kw", [PRO, LLAMA], ids=["pro", "llama"])
def test_truncate_restores_the_state_of_the_prefix(kw):
    layer, x = _layer(kw), _x(2, 14)
    seq_start = torch.tensor([0, 3])
    state = AttentionState(record_past=True)
    for a, b in ((0, 6), (6, 7), (7, 12)):
        layer(x[:, a:b], seq_start=seq_start if a == 0 else None, state=state)
    assert state.length == 12 and state.can_truncate
    state.truncate(8)
    prefix = AttentionState()
    layer(x[:, :8], seq_start=seq_start, state=prefix)
    for name, t in _fields(prefix).items():
        got = _fields(state)[name]
        assert (got is None) == (t is None), name
        if t is not None:
            torch.testing.assert_close(got, t, msg=name)
    out, _ = layer(x[:, 8:], state=state)
    full, _ = layer(x, seq_start=seq_start)
    torch.testing.assert_close(out[1], full[1, 8:])
    torch.testing.assert_close(out[0], full[0, 8:])
    state.truncate(0)
    assert state.length == 0 and state.seq_start is None


def test_truncate_without_the_recorded_past_is_refused_with_a_shift():
    layer, x = _layer(PRO), _x(1, 6)
    state = AttentionState()
    layer(x, state=state)
    assert state.k_history is None and not state.can_truncate
    with pytest.raises(ValueError, match="record_past"):
        state.truncate(3)
    late = AttentionState()
    layer(x[:, :3], state=late)
    late.record_past = True  # from here on: the history would not cover the first chunk
    layer(x[:, 3:], state=late)
    assert not late.can_truncate


def test_batch_row_operations():
    layer, x = _layer(PRO), _x(3, 5)
    state = AttentionState(record_past=True)
    layer(x, state=state)
    nxt = _x(3, 1, seed=2)
    reordered = AttentionState(**{**_fields(state), "k_history": state.k_history, "v_history": state.v_history})
    reordered.reorder(torch.tensor([2, 0, 1]))
    repeated = AttentionState(**_fields(state))
    repeated.repeat_interleave(2)
    want = layer(nxt, state=state)[0]
    torch.testing.assert_close(layer(nxt[[2, 0, 1]], state=reordered)[0], want[[2, 0, 1]])
    torch.testing.assert_close(layer(nxt.repeat_interleave(2, 0), state=repeated)[0], want.repeat_interleave(2, 0))


@pytest.mark.parametrize("kw", [PRO, LLAMA, dict(LLAMA, fgate_type="none", use_rope=True)], ids=["pro", "llama", "rope"])
def test_output_attentions_packed_and_padded(kw):
    """The explicit path gives the kernel's outputs; packed sequences get block-diagonal weights equal to
    each sequence's own, and rows sum to 1 (0 for padding queries)."""
    layer = _layer(kw)
    x = _x(1, 11)
    cu = torch.tensor([0, 4, 11], dtype=torch.int32)
    out, _, w = layer(x, cu_seqlens=cu, output_attentions=True)
    torch.testing.assert_close(out, layer(x, cu_seqlens=cu)[0])
    assert w.shape == (1, 4, 11, 11) and w[0, :, 4:, :4].abs().max() == 0
    for a, b in ((0, 4), (4, 11)):
        _, _, alone = layer(x[:, a:b], output_attentions=True)
        torch.testing.assert_close(w[:, :, a:b, a:b], alone)
    seq_start = torch.tensor([2])
    out, _, w = layer(x, seq_start=seq_start, output_attentions=True)
    torch.testing.assert_close(out[:, 2:], layer(x, seq_start=seq_start)[0][:, 2:])
    torch.testing.assert_close(w.sum(-1)[0, :, 2:], torch.ones(4, 9, dtype=w.dtype))
    assert w[0, :, :2].abs().max() == 0 and w[0, :, :, :2].abs().max() == 0
