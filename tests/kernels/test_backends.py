"""composer.kernels: the device rule, lazy probes, the disable switch, and argument translation.

mamba_ssm, causal_conv1d and transformer_engine cannot run here, so stand-in modules are put in
``sys.modules``: each checks the real function's argument contract (shapes, layouts, dtypes, as
in its source) and computes with our plain-math references. A GPU is emulated by patching
``probe.on_gpu``. A wrapper that translated an argument wrongly (softplus twice, a missing
bias, an unclamped dt, the wrong conv layout) would then disagree with the torch path.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

import composer.kernels as kernels
from composer.blocks.mamba2 import Mamba2Mixer, _at_least_fp32
from composer.blocks.split import SplitCausalConv1d
from composer.config import MambaConfig, ModelConfig
from composer.kernels import probe
from composer.kernels.ssd import ssd_scan_ref
from tests.helpers import only_kernels

OPTIONAL = ("mamba_ssm", "causal_conv1d", "transformer_engine", "triton", "flash_attn")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _fresh_probes(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv(probe.ENV_DISABLE, raising=False)
    probe.reset()
    yield
    probe.reset()


@pytest.fixture
def gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every tensor counts as a CUDA tensor."""
    monkeypatch.setattr(probe, "on_gpu", lambda t: True)


def _install(monkeypatch: pytest.MonkeyPatch, name: str, **attrs) -> types.ModuleType:
    parts = name.split(".")
    for i in range(1, len(parts)):
        monkeypatch.setitem(sys.modules, ".".join(parts[:i]), types.ModuleType(parts[i - 1]))
    mod = types.ModuleType(name)
    for key, value in attrs.items():
        setattr(mod, key, value)
    monkeypatch.setitem(sys.modules, name, mod)
    return mod


# ---------------------------------------------------------------- stand-ins


def fake_mamba_chunk_scan_combined(calls: list):
    def mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None,
                                  initial_states=None, seq_idx=None, dt_softplus=False,
                                  dt_limit=(0.0, float("inf")), return_final_states=False):
        b, T, H, P = x.shape
        G, N = B.shape[2], B.shape[3]
        assert H % G == 0 and dt.shape == (b, T, H) and A.shape == (H,)
        assert B.shape == (b, T, G, N) and C.shape == B.shape
        assert D is None or D.shape in ((H,), (H, P))
        assert dt_bias is None or dt_bias.shape == (H,)
        assert initial_states is None or initial_states.shape == (b, H, P, N)
        assert z is None and seq_idx is None
        calls.append(dict(dt=dt, dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit,
                          D=D, chunk_size=chunk_size, return_final_states=return_final_states))
        # _chunk_cumsum_fwd: fp32 dt, + bias, softplus (identity above 20), clamp always.
        dt = dt.float()
        if dt_bias is not None:
            dt = dt + dt_bias.float()
        if dt_softplus:
            dt = torch.where(dt <= 20.0, torch.log1p(torch.exp(dt)), dt)
        dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
        y, final = ssd_scan_ref(x.float(), dt, A.float(), B.float(), C.float(), D_H=D,
                                initial_state_BHPN=initial_states, return_final_state=True)
        y = y.to(x.dtype)  # the kernel writes its output in x's dtype
        return (y, final) if return_final_states else y

    return mamba_chunk_scan_combined


def fake_causal_conv1d_fn(calls: list):
    def causal_conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None,
                         return_final_states=False, final_states_out=None, activation=None):
        batch, dim, seqlen = x.shape
        width = weight.shape[1]
        assert weight.shape == (dim, width) and 2 <= width <= 4
        assert activation in (None, "silu", "swish")
        assert x.stride(2) == 1 or x.stride(1) == 1
        channel_last = x.stride(1) == 1 and x.stride(2) > 1
        if channel_last:  # the CUDA extension's own checks
            assert dim % 8 == 0 and x.stride(0) % 8 == 0 and x.stride(2) % 8 == 0
        assert bias is None or (bias.dtype == weight.dtype and bias.shape == (dim,))
        calls.append(dict(channel_last=channel_last, activation=activation))
        out = torch.zeros_like(x)
        for k in range(width):  # tap k reads the input (width - 1 - k) steps back
            lag = width - 1 - k
            out[..., lag:] = out[..., lag:] + weight[:, k, None] * x[..., : seqlen - lag]
        if bias is not None:
            out = out + bias[:, None]
        return out * torch.sigmoid(out) if activation in ("silu", "swish") else out

    return causal_conv1d_fn


@pytest.fixture
def fakes(monkeypatch: pytest.MonkeyPatch) -> dict[str, list]:
    calls: dict[str, list] = {"scan": [], "conv": []}
    _install(monkeypatch, "mamba_ssm.ops.triton.ssd_combined",
             mamba_chunk_scan_combined=fake_mamba_chunk_scan_combined(calls["scan"]))
    _install(monkeypatch, "causal_conv1d", causal_conv1d_fn=fake_causal_conv1d_fn(calls["conv"]))
    only_kernels(monkeypatch, "mamba_ssm", "causal_conv1d", "flash")
    return calls


# ---------------------------------------------------------------- inputs


def _scan_inputs(T: int = 10, seed: int = 0) -> tuple[tuple, dict]:
    g = torch.Generator().manual_seed(seed)
    b, H, P, G, N = 2, 4, 3, 2, 5

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    args = (r(b, T, H, P), 2 * r(b, T, H), -torch.exp(r(H)), r(b, T, G, N), r(b, T, G, N), 4)
    kwargs = dict(D_H=r(H), dt_bias_H=r(H), dt_softplus=True, dt_limit=(0.2, 1.5),
                  initial_state_BHPN=r(b, H, P, N), return_final_state=True)
    return args, kwargs


def _mamba_cfg() -> ModelConfig:
    m = MambaConfig(n_heads=4, d_head=8, n_groups=2, d_state=8, d_conv=4, chunk_size=4,
                    dt_limit=(0.01, 2.0))
    return ModelConfig(pattern="M", d_model=32, init_std=0.2, mamba=m)


def _mixer() -> Mamba2Mixer:
    mixer = Mamba2Mixer(_mamba_cfg())
    mixer.reset_parameters(torch.Generator().manual_seed(0))
    with torch.no_grad():
        for p in mixer.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    return mixer


def wired_forward(mixer: Mamba2Mixer, x_BTD: torch.Tensor) -> torch.Tensor:
    """``Mamba2Mixer.forward`` with the composer.kernels hooks in (the lines proposed for
    mamba2.py); the test below holds it to the current forward."""
    m = mixer.mamba_cfg
    b, T, _ = x_BTD.shape
    dt_bias, A_log, D = mixer.dt_bias, mixer.A_log, mixer.D
    H = dt_bias.shape[0]
    G = H * m.n_groups // m.n_heads
    E, F_ = H * m.d_head, G * m.d_state
    z_BTE, xBC_BTX, dt_BTH = mixer.in_proj(x_BTD).split([E, E + 2 * F_, H], dim=-1)
    xBC_BTX = kernels.conv_silu(xBC_BTX, mixer.conv1d)
    x_BTE, B_BTF, C_BTF = xBC_BTX.split([E, F_, F_], dim=-1)
    A_H = -torch.exp(_at_least_fp32(A_log))
    y_BTHP = kernels.mamba_scan(
        x_BTE.view(b, T, H, m.d_head), dt_BTH, A_H, B_BTF.view(b, T, G, m.d_state),
        C_BTF.view(b, T, G, m.d_state), m.chunk_size,
        D_H=D, dt_bias_H=dt_bias, dt_softplus=True, dt_limit=m.dt_limit)
    y_BTE = mixer.norm(y_BTHP.reshape(b, T, E), gate=z_BTE)
    return mixer.out_proj(y_BTE.to(x_BTD.dtype))


# ---------------------------------------------------------------- the device rule


def test_cpu_tensors_take_the_torch_path_and_probe_nothing(fakes: dict) -> None:
    x = torch.zeros(1, 4, 2, 3)
    assert kernels.select_scan(x) is kernels.ssd_scan_torch
    assert kernels.select_conv(torch.zeros(1, 4, 8), 4) is kernels.conv1d_silu_torch
    assert kernels.sdpa_backends(x) is None
    args, kw = _scan_inputs()
    kernels.mamba_scan(*args, **kw)
    assert fakes["scan"] == [] and set(probe._available) <= probe.CPU_KERNELS, \
        "a CPU call must not even probe a GPU kernel"


def test_absent_packages_are_unavailable(monkeypatch: pytest.MonkeyPatch, gpu: None) -> None:
    for name in ("mamba_ssm", "causal_conv1d", "transformer_engine"):
        # import raises ImportError, as if absent (submodules an earlier import left too)
        for loaded in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            monkeypatch.setitem(sys.modules, loaded, None)
        monkeypatch.setitem(sys.modules, name, None)
    x = torch.zeros(1, 4, 2, 3)
    assert kernels.select_scan(x) is kernels.ssd_scan_torch
    assert kernels.select_conv(torch.zeros(1, 4, 8), 4) is kernels.conv1d_silu_torch
    assert kernels.why_unavailable("mamba_ssm").startswith("ModuleNotFoundError")
    assert kernels.sdpa_backends(x)[0] == SDPBackend.FLASH_ATTENTION  # torch's own, no import


def test_import_raising_runtime_error_is_unavailable(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, gpu: None) -> None:
    # transformer_engine without CUDA: a shell whose import raises RuntimeError.
    pkg = tmp_path / "transformer_engine"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise RuntimeError('no CUDA device found')\n")
    (pkg / "pytorch.py").write_text("Linear = None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("transformer_engine", "transformer_engine.pytorch"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    assert kernels.why_unavailable("transformer_engine") == "RuntimeError: no CUDA device found"


@pytest.mark.slow
def test_importing_composer_imports_no_optional_package() -> None:
    code = textwrap.dedent(f"""
        import sys, torch, composer, composer.kernels as k
        from composer.build.registry import REGISTRY
        x = torch.randn(1, 6, 2, 3)
        k.mamba_scan(x, torch.rand(1, 6, 2), -torch.ones(2), torch.randn(1, 6, 1, 4),
                     torch.randn(1, 6, 1, 4), 4, dt_softplus=True)
        with k.sdpa_context(x):
            pass
        print(sorted(m for m in sys.modules if m.split(".")[0] in set({OPTIONAL!r})))
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# ---------------------------------------------------------------- argument translation


def test_scan_kernel_wrapper_matches_torch_path(fakes: dict, gpu: None) -> None:
    args, kw = _scan_inputs()
    leaves = [args[0], args[1], kw["D_H"], kw["dt_bias_H"]]
    assert kernels.select_scan(args[0]) is kernels.ssd_scan_kernel

    def run(fn) -> tuple[torch.Tensor, ...]:
        xs = [t.clone().requires_grad_() for t in leaves]
        y, final = fn(xs[0], xs[1], *args[2:], **{**kw, "D_H": xs[2], "dt_bias_H": xs[3]})
        (y.square().sum() + final.sum()).backward()
        return (y, final, *(t.grad for t in xs))

    got, want = run(kernels.mamba_scan), run(kernels.ssd_scan_torch)
    call = fakes["scan"][0]
    assert call["dt_softplus"] is True and call["dt_limit"] == (0.2, 1.5)
    assert call["dt_bias"].shape == (4,) and call["chunk_size"] == 4
    # the limit is active on both sides, so a dropped clamp would show
    dt = F.softplus(args[1] + kw["dt_bias_H"])
    assert (dt < 0.2).any() and (dt > 1.5).any()
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=2e-5, rtol=2e-5)


def test_scan_kernel_output_dtype_is_at_least_fp32(fakes: dict, gpu: None) -> None:
    args, kw = _scan_inputs()
    args = (args[0].bfloat16(), args[1].bfloat16(), args[2], args[3].bfloat16(),
            args[4].bfloat16(), 4)
    y, final = kernels.mamba_scan(*args, **kw)
    y_ref, final_ref = kernels.ssd_scan_torch(*args, **kw)
    assert y.dtype == y_ref.dtype == torch.float32 and final.dtype == torch.float32
    torch.testing.assert_close(y, y_ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(("sizes", "width", "layout"), [
    ({"x": 16, "B": 8, "C": 8}, 40, "channel_last"),  # C % 8 == 0, row stride % 8 == 0
    ({"x": 6, "B": 3, "C": 3}, 13, "channel_first"),  # C = 12: the kernel needs a copy
])
def test_conv_kernel_wrapper_matches_module(fakes: dict, gpu: None, sizes: dict, width: int,
                                            layout: str) -> None:
    conv = SplitCausalConv1d(sizes, 4, bias=True)
    conv.reset_parameters(torch.Generator().manual_seed(0))
    n = sum(sizes.values())
    # as in the mixer: the conv input is a slice of the wider in_proj output
    x = torch.randn(2, 9, width, generator=torch.Generator().manual_seed(1))[..., 1:1 + n]

    def run(on_gpu: bool) -> tuple[torch.Tensor, ...]:
        conv.zero_grad()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(probe, "on_gpu", lambda t: on_gpu)
            y = kernels.conv_silu(x, conv)
        y.square().sum().backward()
        return (y, *(p.grad.clone() for p in conv.parameters()))

    for g, w in zip(run(True), run(False), strict=True):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-5)
    assert fakes["conv"] == [dict(channel_last=layout == "channel_last", activation="silu")]


def test_conv_width_outside_kernel_range_takes_torch(fakes: dict, gpu: None) -> None:
    assert kernels.select_conv(torch.zeros(1, 4, 8), 5) is kernels.conv1d_silu_torch
    assert kernels.select_conv(torch.zeros(1, 4, 8, dtype=torch.float64), 4) \
        is kernels.conv1d_silu_torch


# ---------------------------------------------------------------- the switch and attention


def test_disable_switch(fakes: dict, gpu: None, monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.zeros(1, 4, 2, 3)
    monkeypatch.setenv(probe.ENV_DISABLE, " mamba_ssm ")
    kernels.reset()
    assert kernels.select_scan(x) is kernels.ssd_scan_torch
    assert kernels.select_conv(torch.zeros(1, 4, 8), 4) is kernels.conv1d_silu_kernel
    assert kernels.why_unavailable("mamba_ssm") == f"disabled by {probe.ENV_DISABLE}"
    monkeypatch.setenv(probe.ENV_DISABLE, "all")
    kernels.reset()
    assert kernels.select_scan(x) is kernels.ssd_scan_torch
    assert kernels.select_conv(torch.zeros(1, 4, 8), 4) is kernels.conv1d_silu_torch
    assert kernels.sdpa_backends(x) == (SDPBackend.MATH,)
    monkeypatch.setenv(probe.ENV_DISABLE, "mamba")
    kernels.reset()
    with pytest.warns(UserWarning, match=r"unknown kernel name\(s\) \['mamba'\]"):
        assert kernels.available("mamba_ssm")


def test_sdpa_context(monkeypatch: pytest.MonkeyPatch) -> None:
    q, k, v = torch.randn(3, 1, 2, 5, 8).unbind(0)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    with kernels.sdpa_context(q):  # CPU: nullcontext, torch's own choice
        torch.testing.assert_close(F.scaled_dot_product_attention(q, k, v, is_causal=True),
                                   want, atol=0, rtol=0)
    monkeypatch.setattr(probe, "on_gpu", lambda t: True)
    assert kernels.sdpa_backends(q) == (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                                        SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)
    monkeypatch.setenv(probe.ENV_DISABLE, "flash")
    kernels.reset()
    with kernels.sdpa_context(q):
        assert not torch.backends.cuda.flash_sdp_enabled()
        got = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.backends.cuda.flash_sdp_enabled(), "the context restores the flags"
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


# ---------------------------------------------------------------- the mixer


def test_wired_forward_equals_current_forward() -> None:
    mixer = _mixer()
    x = torch.randn(2, 11, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(wired_forward(mixer, x), mixer(x), atol=1e-6, rtol=1e-6)


def test_wired_forward_with_kernels_matches_torch(fakes: dict, gpu: None) -> None:
    mixer = _mixer()
    x = torch.randn(2, 11, 32, generator=torch.Generator().manual_seed(2))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(probe, "on_gpu", lambda t: False)
        want = mixer(x)
    got = wired_forward(mixer, x)
    assert len(fakes["scan"]) == 1 and len(fakes["conv"]) == 1
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_mixer_dispatches_to_kernels(fakes: dict, gpu: None) -> None:
    mixer = _mixer()
    x = torch.randn(2, 11, 32, generator=torch.Generator().manual_seed(2))
    got = mixer(x)
    assert fakes["scan"], "Mamba2Mixer.forward did not call the scan kernel"
    assert len(fakes["conv"]) == 1
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(probe, "on_gpu", lambda t: False)
        torch.testing.assert_close(got, mixer(x), atol=1e-5, rtol=1e-5)
