"""The chunked LM head + cross-entropy against ``F.cross_entropy(F.linear(...))``."""

import pytest
import torch

from composer import build_model
from composer.blocks.loss import IGNORE_INDEX, linear_cross_entropy, linear_cross_entropy_ref

F64 = torch.float64


def _inputs(dtype: torch.dtype, n: int = 70, d: int = 12, v: int = 53, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g, dtype=F64).to(dtype)
    w = (torch.randn(v, d, generator=g, dtype=F64) * 0.5).to(dtype)
    t = torch.randint(0, v, (n,), generator=g)
    t[::5] = IGNORE_INDEX
    return h.requires_grad_(), w.requires_grad_(), t


@pytest.mark.parametrize("rows", [None, 1, 16, 69, 70])
@pytest.mark.parametrize("scale", [1.0, 0.3])
def test_loss_and_gradients_match_fp64(rows: int | None, scale: float) -> None:
    h, w, t = _inputs(F64)
    loss = linear_cross_entropy(h, w, t, scale, chunk_rows=rows)
    want = linear_cross_entropy_ref(h, w, t, scale)
    torch.testing.assert_close(loss, want, atol=1e-12, rtol=0)
    # an upstream gradient other than 1 is applied to both inputs
    got = torch.autograd.grad(2.5 * loss, (h, w))
    ref = torch.autograd.grad(2.5 * want, (h, w))
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_dtypes(dtype: torch.dtype) -> None:
    h, w, t = _inputs(dtype)
    loss = linear_cross_entropy(h, w, t, chunk_rows=16)
    assert loss.dtype == torch.float32
    gh, gw = torch.autograd.grad(loss, (h, w))
    assert gh.dtype == dtype and gw.dtype == dtype
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    want = linear_cross_entropy_ref(h64, w64, t)
    rh, rw = torch.autograd.grad(want, (h64, w64))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(loss.double(), want, atol=tol, rtol=tol)
    torch.testing.assert_close(gh.double(), rh, atol=tol * rh.abs().max().item(), rtol=0)
    torch.testing.assert_close(gw.double(), rw, atol=tol * rw.abs().max().item(), rtol=0)


def test_only_the_inputs_that_need_a_gradient_get_one() -> None:
    h, w, t = _inputs(F64)
    (gw,) = torch.autograd.grad(linear_cross_entropy(h.detach(), w, t, chunk_rows=8), (w,))
    (rw,) = torch.autograd.grad(linear_cross_entropy_ref(h.detach(), w, t), (w,))
    torch.testing.assert_close(gw, rw, atol=1e-12, rtol=0)
    with torch.no_grad():
        torch.testing.assert_close(linear_cross_entropy(h, w, t, chunk_rows=8),
                                   linear_cross_entropy_ref(h, w, t), atol=1e-12, rtol=0)


def test_a_second_backward_is_refused() -> None:
    h, w, t = _inputs(F64)
    loss = linear_cross_entropy(h, w, t)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        loss.backward()


def test_every_target_ignored_is_nan_like_cross_entropy() -> None:
    h, w, t = _inputs(F64)
    t[:] = IGNORE_INDEX
    assert linear_cross_entropy(h, w, t).isnan() and linear_cross_entropy_ref(h, w, t).isnan()


@pytest.mark.parametrize("tie", [False, True])
def test_model_loss_equals_the_logits_path(tie: bool) -> None:
    """``model(ids, labels)`` (chunked) and ``return_logits=True`` (whole logits) agree, with
    every parameter's gradient, tied embeddings included."""
    from composer.config import AttentionConfig, MLPConfig, ModelConfig

    cfg = ModelConfig(pattern="*-", d_model=16, vocab_size=61, tie_embeddings=tie,
                      logits_scaling=2.0, attention=AttentionConfig(n_heads=2),
                      mlp=MLPConfig(d_ff=32))
    model = build_model(cfg, seed=1).double()
    ids = torch.randint(0, 61, (3, 10), generator=torch.Generator().manual_seed(2))
    labels = ids.clone()
    labels[1, 4] = IGNORE_INDEX
    out = model(ids, labels)
    assert out.logits is None
    grads = torch.autograd.grad(out.loss, list(model.parameters()))
    full = model(ids, labels, return_logits=True)
    assert full.logits is not None and full.logits.shape == (3, 10, 61)
    want = torch.autograd.grad(full.loss, list(model.parameters()))
    torch.testing.assert_close(out.loss, full.loss, atol=1e-12, rtol=0)
    for a, b in zip(grads, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
