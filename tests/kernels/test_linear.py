"""``composer.kernels.linear``: the oneDNN CPU linear against the fp64 product, its gradients,
and the cases that must take ``F.linear`` instead.

Error model: an fp32 dot product of length ``K`` (either library, any summation order) is within
``K * eps * sum_k |a_k b_k|`` of the exact one; the tests allow that bound, computed per entry
from the absolute values in fp64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import composer.kernels.linear as kl
from composer.kernels import probe

EPS = torch.finfo(torch.float32).eps
pytestmark = pytest.mark.skipif(not kl.onednn_present(), reason="torch built without oneDNN")


def _within(got: torch.Tensor, a: torch.Tensor, b: torch.Tensor, k: int) -> None:
    """``got`` (fp32) against the fp64 ``a @ b`` within the dot-product bound."""
    exact = a.double() @ b.double()
    bound = k * EPS * (a.double().abs() @ b.double().abs()) + 1e-30
    excess = ((got.double() - exact).abs() / bound).max().item()
    assert excess <= 1.0, f"error {excess:.2f} x the fp32 bound"


@pytest.fixture
def calls(monkeypatch):
    """How often oneDNN ran (``_mm_t``)."""
    seen = []
    real = kl._mm_t

    def counted(*args):
        seen.append(args[0].shape)
        return real(*args)

    monkeypatch.setattr(kl, "_mm_t", counted)
    return seen


@pytest.mark.parametrize("bias", [False, True])
def test_forward_and_gradients_match_the_exact_product(calls, bias: bool) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 48, generator=g, requires_grad=True)
    w = torch.randn(40, 48, generator=g, requires_grad=True)
    b = torch.randn(40, generator=g, requires_grad=True) if bias else None
    dy = torch.randn(3, 5, 40, generator=g)
    y = kl.linear(x, w, b)
    y.backward(dy)
    assert len(calls) == 2  # the product and dx
    x2, dy2 = x.detach().reshape(15, 48), dy.reshape(15, 40)
    y_ref = y.detach() - (b.detach() if bias else 0.0)
    _within(y_ref.reshape(15, 40), x2, w.detach().T, 48)
    _within(x.grad.reshape(15, 48), dy2, w.detach(), 40)
    _within(w.grad, dy2.T, x2, 15)
    if bias:
        torch.testing.assert_close(b.grad, dy2.sum(0), rtol=1e-6, atol=1e-6)


def test_equals_f_linear_where_it_falls_back(calls, monkeypatch) -> None:
    x, w = torch.randn(4, 16), torch.randn(8, 16)
    # fp64, bf16 and autocast take F.linear
    for xx, ww in ((x.double(), w.double()), (x.bfloat16(), w.bfloat16())):
        torch.testing.assert_close(kl.linear(xx, ww), F.linear(xx, ww), rtol=0, atol=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = kl.linear(x, w)
    assert out.dtype == torch.bfloat16
    assert calls == []
    # switched off by the variable
    monkeypatch.setenv(probe.ENV_DISABLE, "onednn")
    probe.reset()
    try:
        torch.testing.assert_close(kl.linear(x, w), F.linear(x, w), rtol=0, atol=0)
        assert calls == [] and "disabled" in probe.why_unavailable("onednn")
    finally:
        monkeypatch.delenv(probe.ENV_DISABLE)
        probe.reset()
    kl.linear(x, w)
    assert len(calls) == 1


def test_a_tensor_subclass_takes_f_linear(calls) -> None:
    class Tagged(torch.Tensor):
        """Computes as a tensor, but is not one by type (as DTensor and float8 weights)."""

    x = torch.randn(2, 8).as_subclass(Tagged)
    kl.linear(x, torch.randn(4, 8))
    assert calls == []


def test_module_is_an_nn_linear_with_its_keys_and_values() -> None:
    torch.manual_seed(0)
    ours = kl.Linear(12, 6)
    ref = nn.Linear(12, 6)
    ref.load_state_dict(ours.state_dict())
    assert isinstance(ours, nn.Linear) and list(ours.state_dict()) == ["weight", "bias"]
    x = torch.randn(7, 12).T.contiguous().T  # a non-contiguous input
    torch.testing.assert_close(ours(x), ref(x), rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # one decoding row, no graph
        torch.testing.assert_close(ours(x[:1]), ref(x[:1]), rtol=1e-5, atol=1e-5)


def test_head_helpers(calls) -> None:
    a, w = torch.randn(5, 16), torch.randn(9, 16)
    _within(kl.mm_nt(a, w), a, w.T, 16)
    d = torch.randn(5, 9)
    _within(kl.mm_nn(d, w), d, w, 9)
    assert len(calls) == 2


def test_dispatch_modes_see_f_linear(calls) -> None:
    """Under a TorchDispatchMode (FlopCounterMode here; selective checkpointing's policy) the
    product is ``aten.mm``, which such modes know: counted, saved."""
    from torch.utils.flop_counter import FlopCounterMode

    x, w = torch.randn(4, 16), torch.randn(8, 16)
    with FlopCounterMode(display=False) as counter:
        kl.linear(x, w)
    assert calls == [] and counter.get_total_flops() == 2 * 4 * 16 * 8
