"""Packed documents on the kernel paths: the wrappers hand mamba_ssm and causal_conv1d a
``seq_idx`` they accept (int32, contiguous, 0 for each row's first document, a channel-last conv
input), and the mixer with the kernels equals its torch path. As in ``test_backends.py`` the
kernels are stand-ins in ``sys.modules`` that check the real contract and compute with our
references, and a GPU is emulated by patching ``probe.on_gpu``."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from composer.blocks.mamba2 import Mamba2Mixer
from composer.config import MambaConfig, ModelConfig
from composer.kernels import probe
from composer.kernels.ssd import ssd_scan_ref
from tests.helpers import only_kernels


def _install(monkeypatch: pytest.MonkeyPatch, name: str, **attrs) -> None:
    parts = name.split(".")
    for i in range(1, len(parts)):
        monkeypatch.setitem(sys.modules, ".".join(parts[:i]), types.ModuleType(parts[i - 1]))
    mod = types.ModuleType(name)
    for key, value in attrs.items():
        setattr(mod, key, value)
    monkeypatch.setitem(sys.modules, name, mod)


def _check_seq_idx(seq_idx: torch.Tensor, b: int, t: int) -> None:
    assert seq_idx.dtype == torch.int32 and seq_idx.is_contiguous()
    assert seq_idx.shape == (b, t)
    assert (seq_idx[:, 0] == 0).all(), "mamba_ssm's state passing starts at sequence 0"
    assert (seq_idx[:, 1:] >= seq_idx[:, :-1]).all()


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, list]:
    out: dict[str, list] = {"scan": [], "conv": []}

    def mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None,
                                  initial_states=None, seq_idx=None, dt_softplus=False,
                                  dt_limit=(0.0, float("inf")), return_final_states=False):
        _check_seq_idx(seq_idx, *x.shape[:2])
        out["scan"].append(seq_idx)
        dt = dt.float() + dt_bias.float()
        dt = torch.where(dt <= 20.0, torch.log1p(torch.exp(dt)), dt) if dt_softplus else dt
        dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
        y = ssd_scan_ref(x.float(), dt, A.float(), B.float(), C.float(), D_H=D,
                         initial_state_BHPN=initial_states, doc_ids=seq_idx)
        return y.to(x.dtype)

    def causal_conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None,
                         return_final_states=False, final_states_out=None, activation=None):
        batch, dim, seqlen = x.shape
        width = weight.shape[1]
        # csrc/causal_conv1d.cpp: seq_idx only with the channel-last layout, int32, contiguous
        assert x.stride(1) == 1 and x.stride(2) > 1, "seq_idx needs channel-last"
        assert dim % 8 == 0 and x.stride(0) % 8 == 0 and x.stride(2) % 8 == 0
        _check_seq_idx(seq_idx, batch, seqlen)
        out["conv"].append(seq_idx)
        y = torch.zeros_like(x)
        for k in range(width):
            lag = width - 1 - k
            same = (seq_idx[:, lag:] == seq_idx[:, : seqlen - lag])[:, None]
            y[..., lag:] = y[..., lag:] + weight[:, k, None] * x[..., : seqlen - lag] * same
        y = y + bias[:, None]
        return y * torch.sigmoid(y) if activation == "silu" else y

    _install(monkeypatch, "mamba_ssm.ops.triton.ssd_combined",
             mamba_chunk_scan_combined=mamba_chunk_scan_combined)
    _install(monkeypatch, "causal_conv1d", causal_conv1d_fn=causal_conv1d_fn)
    only_kernels(monkeypatch, "mamba_ssm", "causal_conv1d", "flash")
    yield out
    probe.reset()


def _mixer(d_state: int) -> Mamba2Mixer:
    m = MambaConfig(n_heads=4, d_head=8, n_groups=2, d_state=d_state, chunk_size=4,
                    conv_bias=True)
    mixer = Mamba2Mixer(ModelConfig(pattern="M", d_model=32, init_std=0.2, mamba=m))
    mixer.reset_parameters(torch.Generator().manual_seed(0))
    with torch.no_grad():
        for p in mixer.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    return mixer


@pytest.mark.parametrize("d_state", [8, 5], ids=["conv-kernel", "conv-torch"])
def test_mixer_kernels_with_docs_match_torch(calls: dict, monkeypatch: pytest.MonkeyPatch,
                                             d_state: int) -> None:
    """Conv channels 32 + 2*2*8 = 64 go to the conv kernel; 52 (not a multiple of 8) cannot take
    ``seq_idx`` there and stay on the torch path while the scan still runs the kernel."""
    mixer = _mixer(d_state)
    x = torch.randn(2, 13, 32, generator=torch.Generator().manual_seed(2))
    docs = torch.tensor([[7] * 5 + [9] * 8, [2] * 3 + [3] + [4] * 9])
    want, mixed = mixer(x, doc_ids=docs), mixer(x)  # CPU: torch path, probes nothing
    assert calls == {"scan": [], "conv": []} and set(probe._available) <= probe.CPU_KERNELS
    monkeypatch.setattr(probe, "on_gpu", lambda t: True)
    got = mixer(x, doc_ids=docs)
    expected_seq_idx = [[0] * 5 + [1] * 8, [0] * 3 + [1] + [2] * 9]
    assert [s.tolist() for s in calls["scan"]] == [expected_seq_idx]
    assert [s.tolist() for s in calls["conv"]] == ([expected_seq_idx] if d_state == 8 else [])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert (mixed - want).abs().max() > 1e-2  # the documents matter
