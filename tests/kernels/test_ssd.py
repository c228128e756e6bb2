"""The chunked SSD scan and its hand-written backward against the step-by-step recurrence
(fp64, atol 1e-10), and against autograd's numerical gradient."""

from __future__ import annotations

import pytest
import torch

from composer.kernels.ssd import ssd_scan, ssd_scan_ref

F64 = torch.float64


def _inputs(
    T: int,
    H: int = 4,
    G: int = 2,
    P: int = 3,
    N: int = 5,
    b: int = 2,
    dtype: torch.dtype = F64,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "x_BTHP": torch.randn(b, T, H, P, generator=g, dtype=dtype),
        # Wide dt and A ranges so that some heads nearly forget within a chunk and others do not.
        "dt_BTH": (torch.rand(b, T, H, generator=g, dtype=F64) * 0.9 + 0.01).to(dtype),
        "A_H": -torch.exp(torch.randn(H, generator=g, dtype=F64)).to(dtype),
        "B_BTGN": torch.randn(b, T, G, N, generator=g, dtype=dtype),
        "C_BTGN": torch.randn(b, T, G, N, generator=g, dtype=dtype),
    }


def _close(a: torch.Tensor, b: torch.Tensor, atol: float = 1e-10) -> None:
    torch.testing.assert_close(a, b, atol=atol, rtol=0)


@pytest.mark.parametrize(("T", "chunk"), [(37, 8), (37, 16), (37, 64), (32, 8), (1, 4)])
@pytest.mark.parametrize("with_D", [False, True])
def test_scan_matches_recurrence(T: int, chunk: int, with_D: bool) -> None:
    inp = _inputs(T)
    D_H = torch.randn(4, dtype=F64) if with_D else None
    _close(ssd_scan(**inp, chunk_size=chunk, D_H=D_H), ssd_scan_ref(**inp, D_H=D_H))


@pytest.mark.parametrize(("T", "chunk"), [(37, 8), (32, 8), (5, 16)])
def test_initial_and_final_state(T: int, chunk: int) -> None:
    inp = _inputs(T, H=6, G=3)
    h0 = torch.randn(2, 6, 3, 5, dtype=F64)
    D_H = torch.randn(6, dtype=F64)
    y, final = ssd_scan(
        **inp, chunk_size=chunk, D_H=D_H, initial_state_BHPN=h0, return_final_state=True
    )
    y_ref, final_ref = ssd_scan_ref(**inp, D_H=D_H, initial_state_BHPN=h0, return_final_state=True)
    _close(y, y_ref)
    _close(final, final_ref)


def test_final_state_continues_the_scan() -> None:
    """Scanning [0, 20) then [20, 37) from the returned state equals one scan of [0, 37)."""
    inp = _inputs(37)
    y_all = ssd_scan(**inp, chunk_size=8)
    first = {k: (v[:, :20] if v.dim() > 1 else v) for k, v in inp.items()}
    rest = {k: (v[:, 20:] if v.dim() > 1 else v) for k, v in inp.items()}
    y0, h = ssd_scan(**first, chunk_size=8, return_final_state=True)
    y1 = ssd_scan(**rest, chunk_size=8, initial_state_BHPN=h)
    _close(torch.cat([y0, y1], 1), y_all)


def test_groups_are_shared_by_consecutive_heads() -> None:
    """Head h reads group h // (H // G): G groups equal H heads with B/C repeated per head."""
    inp = _inputs(19, H=4, G=2)
    wide = dict(
        inp,
        B_BTGN=inp["B_BTGN"].repeat_interleave(2, 2),
        C_BTGN=inp["C_BTGN"].repeat_interleave(2, 2),
    )
    _close(ssd_scan(**inp, chunk_size=8), ssd_scan(**wide, chunk_size=8))


def test_bf16_in_bf16_out_and_close_to_fp32() -> None:
    inp = _inputs(37, dtype=torch.float32)
    y32 = ssd_scan(**inp, chunk_size=8)
    y16 = ssd_scan(**{k: v.bfloat16() for k, v in inp.items()}, chunk_size=8)
    assert y16.dtype == torch.bfloat16
    y32_from16 = ssd_scan(**{k: v.bfloat16().float() for k, v in inp.items()}, chunk_size=8)
    # Inside the scan bf16 inputs are upcast, so only the final rounding differs.
    torch.testing.assert_close(y16.float(), y32_from16, atol=0, rtol=2**-8)
    assert y32.dtype == torch.float32


def test_causal() -> None:
    inp = _inputs(37)
    y = ssd_scan(**inp, chunk_size=8)
    changed = {k: v.clone() for k, v in inp.items()}
    for k in ("x_BTHP", "dt_BTH", "B_BTGN", "C_BTGN"):
        changed[k][:, 21:] = changed[k][:, 21:] + 1.0
    y2 = ssd_scan(**changed, chunk_size=8)
    _close(y2[:, :21], y[:, :21], atol=0)
    assert (y2[:, 21:] - y[:, 21:]).abs().max() > 1e-3


def test_gradients_flow() -> None:
    inp = {k: v.float().requires_grad_() for k, v in _inputs(37).items()}
    y, h = ssd_scan(**inp, chunk_size=8, return_final_state=True)
    (y.square().sum() + h.square().sum()).backward()
    for name, t in inp.items():
        assert t.grad is not None and torch.isfinite(t.grad).all(), name
        assert t.grad.abs().sum() > 0, name


@pytest.mark.parametrize(("T", "chunk", "G"), [(37, 8, 2), (32, 8, 1), (5, 16, 2), (37, 64, 4)])
@pytest.mark.parametrize("with_state", [False, True])
def test_gradients_match_recurrence(T: int, chunk: int, G: int, with_state: bool) -> None:
    """Every input's gradient (x, dt, A, B, C, D, initial state) through y and the final state."""
    inp = {k: v.requires_grad_() for k, v in _inputs(T, H=4, G=G).items()}
    inp["D_H"] = torch.randn(4, dtype=F64, requires_grad=True)
    if with_state:
        inp["initial_state_BHPN"] = torch.randn(2, 4, 3, 5, dtype=F64, requires_grad=True)
    g = torch.Generator().manual_seed(5)
    y, h = ssd_scan(**inp, chunk_size=chunk, return_final_state=True)
    y_ref, h_ref = ssd_scan_ref(**inp, return_final_state=True)
    wy = torch.randn(y.shape, generator=g, dtype=F64)
    wh = torch.randn(h.shape, generator=g, dtype=F64)
    for weights_h in (wh, None):  # with and without a gradient arriving at the final state
        loss = (y * wy).sum() + ((h * weights_h).sum() if weights_h is not None else 0)
        loss_ref = (y_ref * wy).sum() + ((h_ref * weights_h).sum() if weights_h is not None else 0)
        grads = torch.autograd.grad(loss, list(inp.values()), retain_graph=True)
        grads_ref = torch.autograd.grad(loss_ref, list(inp.values()), retain_graph=True)
        for name, got, want in zip(inp, grads, grads_ref, strict=True):
            torch.testing.assert_close(got, want, atol=1e-9, rtol=0, msg=name)


def test_gradcheck() -> None:
    inp = {k: v.requires_grad_() for k, v in _inputs(11, H=4, G=2, P=2, N=3, b=1).items()}
    h0 = torch.randn(1, 4, 2, 3, dtype=F64, requires_grad=True)

    def fn(x, dt, A, B, C, h):
        return ssd_scan(x, dt, A, B, C, 4, initial_state_BHPN=h, return_final_state=True)

    assert torch.autograd.gradcheck(fn, (*inp.values(), h0))


def test_fp32_decay_keeps_its_digits_behind_a_large_cumulative_sum() -> None:
    """The ``L x L`` decay ``exp(cs_l - cs_s)`` in fp32 stays within a few ``eps`` (relative) of
    the fp64 one when the cumulative sums are large and their differences small: a first step
    that decays by ``exp(-5000)`` puts every later sum near -5000, where fp32 spacing is 5e-4.
    Subtracting the two sums rounded to fp32 would be off by up to that in the exponent, i.e. a
    relative error of ~5e-4 on decays near 1 (checked below, so that this test can fail)."""
    from composer.kernels.ssd import _Chunked

    g = torch.Generator().manual_seed(3)
    b, T, H, P, G, N, L = 1, 32, 2, 2, 1, 2, 32
    dt64 = torch.rand(b, T, H, generator=g, dtype=F64) * 0.01 + 0.001
    dt64[:, 0] = 5000.0
    A64 = -torch.ones(H, dtype=F64)
    x = torch.randn(b, T, H, P, generator=g)
    Bm, Cm = torch.randn(b, T, G, N, generator=g), torch.randn(b, T, G, N, generator=g)
    dt32 = dt64.float()
    c = _Chunked(x, dt32, A64.float(), Bm, Cm, L)
    got = c.decay()
    cs_BTH = (dt32.double() * A64).cumsum(1)  # the fp64 sums of the same fp32 steps
    cs_BHL = cs_BTH.permute(0, 2, 1)
    exact = torch.exp(cs_BHL[..., :, None] - cs_BHL[..., None, :]).tril()
    exact = exact.view(b, 1, G, H, L, L)
    live = exact > 1e-30
    rel = ((got.double() - exact).abs() / exact.clamp_min(1e-300))[live]
    assert rel.max() < 8 * torch.finfo(torch.float32).eps, rel.max()
    naive = torch.exp(cs_BHL.float()[..., :, None] - cs_BHL.float()[..., None, :]).tril()
    naive_rel = ((naive.double().view_as(exact) - exact).abs() / exact.clamp_min(1e-300))[live]
    assert naive_rel.max() > 1e-5  # the plain fp32 difference does lose digits here
