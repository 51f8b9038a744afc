import pytest
import torch
import torch.nn.functional as F

from fox_models.loss import per_token_cross_entropy

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pad_multiple", [None, 16, 128])
def test_chunked_padded_loss_matches_plain_cross_entropy(device, pad_multiple):
    """Chunked, recomputed, vocabulary-padded loss == plain float64 cross-entropy, values and gradients,
    with ignored labels, an odd vocabulary and chunks that do not divide the tokens."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    g = torch.Generator().manual_seed(0)
    B, T, D, V = 2, 37, 24, 101
    hidden = torch.randn(B, T, D, generator=g, dtype=torch.float64)
    weight = torch.randn(V, D, generator=g, dtype=torch.float64)
    labels = torch.randint(0, V, (B, T), generator=g)
    labels[0, :5] = -100
    h1, w1 = (x.clone().to(device).requires_grad_() for x in (hidden, weight))
    got = per_token_cross_entropy(h1, w1, labels.to(device), chunk_tokens=16, pad_multiple=pad_multiple)
    h2, w2 = (x.clone().requires_grad_() for x in (hidden, weight))
    want = F.cross_entropy((h2 @ w2.T).reshape(B * T, V), labels.reshape(-1), reduction="none").view(B, T)
    torch.testing.assert_close(got.double().cpu(), want, rtol=1e-6, atol=1e-6)
    assert (got[0, :5] == 0).all()
    cot = torch.randn(B, T, generator=g, dtype=torch.float64)
    got.backward(cot.to(device, got.dtype))
    want.backward(cot)
    torch.testing.assert_close(h1.grad.cpu(), h2.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(w1.grad.cpu(), w2.grad, rtol=1e-6, atol=1e-6)
    assert w1.grad.shape == (V, D)
