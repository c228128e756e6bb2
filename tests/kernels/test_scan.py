"""The scan's helpers outside the scan itself (composer.kernels.scan)."""

import pytest
import torch


@pytest.mark.parametrize("docs", [False, True])
def test_end_state_is_the_scans(docs: bool) -> None:
    """ssd_end_state (context parallelism's closed form) gives the scan's final state from zero
    and, with its decay, from any start state; fp64, with and without documents."""
    from composer.kernels.packing import doc_segments
    from composer.kernels.scan import ssd_end_state, ssd_scan_torch

    g = torch.Generator().manual_seed(0)
    b, T, H, P, G, N = 2, 13, 4, 3, 2, 5

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    x, dt, B, C, bias = r(b, T, H, P), r(b, T, H), r(b, T, G, N), r(b, T, G, N), r(H)
    A = -torch.rand(H, generator=g, dtype=torch.float64)
    doc = torch.tensor([[0] * 5 + [1] * 8, [3] * 13]) if docs else None
    kw = dict(dt_bias_H=bias, dt_softplus=True)
    end, decay = ssd_end_state(x, dt, A, B, None if doc is None else doc_segments(doc), **kw)
    start = r(b, H, P, N)
    for init, want in ((None, end), (start, decay[..., None, None] * start + end)):
        _, final = ssd_scan_torch(x, dt, A, B, C, 8, **kw, doc_ids=doc, initial_state_BHPN=init,
                                  return_final_state=True)
        assert (final - want).abs().max() < 1e-12
