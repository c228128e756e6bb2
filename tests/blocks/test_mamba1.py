"""Mamba1Mixer (S): the chunked selective scan equals the sequential recurrence (fp64 1e-12,
states, documents, lengths that are not multiples of the chunk), its bounded-memory backward
equals autograd through the recurrence (fp64 1e-10, gradcheck), the context-parallel end state,
the block's plain-math twin (fp64 1e-10, every inner-norm option), packed documents equal
documents alone, cached decoding equals the full forward, parity with transformers'
JambaMambaMixer (learned dt/B/C norms) and FalconMambaMixer (weightless ones) in fp32, init,
FLOPs, the kind's record (its tensor-parallel refusal), the mamba_ssm wrapper's argument
translation, and a model that trains."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch
import torch.nn.functional as F

import composer
from composer.blocks.mamba1 import Mamba1Config, Mamba1Mixer, SelectiveScan, mamba1_ref
from composer.build.builder import build_model, check_model
from composer.config import ConfigError, ModelConfig
from composer.kernels import selective_scan as ss
from composer.kernels.selective_scan import (
    selective_end_state,
    selective_scan_chunked,
    selective_scan_ref,
    selective_scan_torch,
)
from composer.parallel.mesh import LayoutError, ParallelConfig, resolve_layout
from tests.helpers import adamw_losses, randomize, rel_err

F64 = torch.float64
# transformers picks mamba_ssm / causal_conv1d when they import, and those need CUDA.
HF_KERNELS = any(importlib.util.find_spec(p) for p in ("mamba_ssm", "causal_conv1d"))
DOCS = torch.tensor([[0] * 10 + [1] * 20 + [2] * 7, [4] * 37])


def _inputs(b: int = 2, T: int = 37, E: int = 6, N: int = 5, seed: int = 0, grad: bool = False):
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=F64)

    x, B, C, D, h0 = r(b, T, E), r(b, T, N), r(b, T, N), r(E), r(b, E, N)
    dt = 2 * torch.rand(b, T, E, generator=g, dtype=F64)  # large steps: decays down to e^-20
    A = -10 * torch.rand(E, N, generator=g, dtype=F64)
    out = [x, dt, A, B, C, D, h0]
    return [t.requires_grad_() for t in out] if grad else out


@pytest.mark.parametrize("chunk", [1, 5, 8, 37, 64])
@pytest.mark.parametrize("docs", [False, True])
def test_chunked_equals_sequential_fp64(chunk: int, docs: bool) -> None:
    x, dt, A, B, C, D, h0 = _inputs()
    doc_ids = DOCS if docs else None
    for init in (None, h0):
        y, h = selective_scan_chunked(x, dt, A, B, C, chunk, D_E=D, initial_state_BEN=init,
                                      return_final_state=True, doc_ids=doc_ids)
        y_ref, h_ref = selective_scan_ref(x, dt, A, B, C, D_E=D, initial_state_BEN=init,
                                          return_final_state=True, doc_ids=doc_ids)
        torch.testing.assert_close(y, y_ref, atol=1e-12, rtol=0)
        torch.testing.assert_close(h, h_ref, atol=1e-12, rtol=0)


@pytest.mark.parametrize("docs", [False, True])
def test_gradients_match_sequential_fp64(docs: bool) -> None:
    """The recomputing backward (chunks of 8 over 37 steps: a short last chunk) equals autograd
    through the sequential recurrence, for every input, the start state included."""
    doc_ids = DOCS if docs else None
    inputs = _inputs(grad=True)
    g = torch.Generator().manual_seed(9)
    wy = torch.randn(2, 37, 6, generator=g, dtype=F64)
    wh = torch.randn(2, 6, 5, generator=g, dtype=F64)
    grads = []
    for fn in (lambda *a: selective_scan_chunked(*a[:5], 8, D_E=a[5], initial_state_BEN=a[6],
                                                 return_final_state=True, doc_ids=doc_ids),
               lambda *a: selective_scan_ref(*a[:5], D_E=a[5], initial_state_BEN=a[6],
                                             return_final_state=True, doc_ids=doc_ids)):
        y, h = fn(*inputs)
        grads.append(torch.autograd.grad((y * wy).sum() + (h * wh).sum(), inputs))
    for got, want in zip(*grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-10, rtol=0)


def test_gradcheck_tiny() -> None:
    x, dt, A, B, C, D, h0 = _inputs(b=1, T=7, E=2, N=3, grad=True)

    def fn(x, dt, A, B, C, h0):
        return selective_scan_chunked(x, dt, A, B, C, 3, initial_state_BEN=h0,
                                      return_final_state=True, doc_ids=DOCS[:1, 8:15])

    assert torch.autograd.gradcheck(fn, (x, dt, A, B, C, h0))


def test_large_steps_do_not_overflow() -> None:
    """dt * A of -1e4 per step (a cumulative sum of it would overflow exp in fp32)."""
    x, dt, A, B, C, D, h0 = (t.float() for t in _inputs())
    y = selective_scan_chunked(x, dt * 1e3, A, B, C, 32, D_E=D)
    y_ref = selective_scan_ref(*(t.double() for t in (x, dt * 1e3, A, B, C)), D_E=D.double())
    assert torch.isfinite(y).all() and rel_err(y, y_ref) < 1e-5


@pytest.mark.parametrize("docs", [False, True])
def test_end_state_is_the_scans(docs: bool) -> None:
    """Context parallelism's contract: from any start state the span ends at
    ``decay * start + local``; masked steps (padding) are identity steps."""
    x, dt, A, B, C, _, h0 = _inputs()
    bias = torch.randn(6, generator=torch.Generator().manual_seed(3), dtype=F64)
    doc_ids = DOCS if docs else None
    kw = dict(dt_bias_E=bias, dt_softplus=True)
    local, decay = selective_end_state(x, dt, A, B, 8, doc_ids=doc_ids, **kw)
    for init, want in ((None, local), (h0, decay * h0 + local)):
        _, final = selective_scan_torch(x, dt, A, B, C, 8, **kw, initial_state_BEN=init,
                                        return_final_state=True, doc_ids=doc_ids)
        torch.testing.assert_close(final, want, atol=1e-12, rtol=0)
    # padding after a span (the adaptive layout's pieces: one document each, no doc ids)
    keep = torch.ones(2, 37, dtype=torch.bool)
    keep[:, 30:] = False
    masked = SelectiveScan().mask_steps([x, dt, B, C], keep)
    local2, decay2 = selective_end_state(*masked[:2], A, masked[2], 8, **kw)
    short, short_decay = selective_end_state(x[:, :30], dt[:, :30], A, B[:, :30], 8, **kw)
    torch.testing.assert_close(local2, short, atol=1e-12, rtol=0)
    torch.testing.assert_close(decay2, short_decay, atol=1e-12, rtol=0)


# ---------------------------------------------------------------- the block


def _cfg(inner_norms: str = "learned", proj_bias: bool = False, conv_bias: bool = True,
         eps: float | None = None) -> ModelConfig:
    m = Mamba1Config(d_inner=48, d_state=6, dt_rank=5, inner_norms=inner_norms,
                     proj_bias=proj_bias, conv_bias=conv_bias, inner_norm_eps=eps)
    return ModelConfig(pattern="S", d_model=32, init_std=0.2, mamba1=m)


def _mixer(cfg: ModelConfig, seed: int = 0) -> Mamba1Mixer:
    mixer = Mamba1Mixer(cfg)
    mixer.reset_parameters(torch.Generator().manual_seed(seed))
    randomize(mixer, seed + 1, std=0.3)
    return mixer


def _x(T: int = 37, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(2, T, 32, generator=torch.Generator().manual_seed(5), dtype=dtype)


CASES = [dict(inner_norms="none"), dict(inner_norms="learned", proj_bias=True),
         dict(inner_norms="weightless", eps=1e-3), dict(conv_bias=False)]


@pytest.mark.parametrize("kwargs", CASES)
@pytest.mark.parametrize("docs", [False, True])
def test_block_matches_ref_fp64(kwargs: dict, docs: bool) -> None:
    cfg = _cfg(**kwargs)
    mixer = _mixer(cfg).double()
    x = _x(dtype=F64)
    weights = {k: v.detach() for k, v in mixer.state_dict().items()}
    doc_ids = DOCS if docs else None
    with torch.no_grad():
        got, want = mixer(x, doc_ids=doc_ids), mamba1_ref(x, weights, cfg, doc_ids)
    assert rel_err(got, want) < 1e-12


def test_packed_documents_equal_documents_alone() -> None:
    mixer = _mixer(_cfg()).double()
    x = _x(dtype=F64)
    with torch.no_grad():
        packed = mixer(x, doc_ids=DOCS)
        for lo, hi in ((0, 10), (10, 30), (30, 37)):
            torch.testing.assert_close(packed[:1, lo:hi], mixer(x[:1, lo:hi]), atol=1e-12,
                                       rtol=0)


def _model_cfg(**mamba1) -> ModelConfig:
    return ModelConfig.from_dict({
        "pattern": "S*S-", "d_model": 32, "vocab_size": 61, "attention": {"n_heads": 4,
                                                                          "position": "none"},
        "mlp": {"d_ff": 64}, "mamba1": {"d_inner": 48, "d_state": 6, "dt_rank": 4,
                                        "inner_norms": "learned", **mamba1}})


def test_cached_decoding_equals_full_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    """A left-padded prompt (prefill over several scan chunks), then token by token, equals the
    full forward; the padded row equals its prompt alone; the state's size is constant."""
    monkeypatch.setattr(ss, "TORCH_CHUNK", 4)
    model = build_model(_model_cfg(), seed=0, dtype=F64).eval()
    randomize(model, seed=3)
    ids = torch.randint(0, 61, (2, 14), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, :3] = 0
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache(2, 14)
        got = [model.forward_cached(ids[:, :10], cache, attention_mask=mask, last_only=False)]
        state = cache.layers[0].state
        got += [model.forward_cached(ids[:, t:t + 1], cache, last_only=False)
                for t in range(10, 14)]
        alone = model(ids[1:, 3:])
    got = torch.cat(got, 1)
    assert cache.layers[0].state is state and tuple(state.shape) == (2, 48, 6)
    assert tuple(cache.layers[0].conv_BXW.shape) == (2, 48, 3)
    torch.testing.assert_close(got[0], full[0], rtol=0, atol=1e-10)
    torch.testing.assert_close(got[1, 3:], alone[0], rtol=0, atol=1e-10)


def _hf_jamba_mixer(proj_bias: bool):
    from transformers import JambaConfig
    from transformers.models.jamba.modeling_jamba import JambaMambaMixer

    hf_cfg = JambaConfig(hidden_size=32, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
                         mamba_dt_rank=6, rms_norm_eps=1e-6, mamba_proj_bias=proj_bias,
                         num_hidden_layers=1, vocab_size=16, num_attention_heads=4,
                         num_key_value_heads=2)
    return JambaMambaMixer(hf_cfg, layer_idx=0).eval()


@pytest.mark.skipif(HF_KERNELS, reason="transformers would pick the CUDA kernels")
@pytest.mark.parametrize("proj_bias", [False, True])
def test_parity_transformers_jamba(proj_bias: bool) -> None:
    hf = _hf_jamba_mixer(proj_bias)
    randomize(hf, seed=3)
    cfg = ModelConfig(pattern="S", d_model=32, norm_eps=1e-6, mamba1=Mamba1Config(
        d_inner=64, d_state=8, dt_rank=6, inner_norms="learned",
        proj_bias=proj_bias))
    ours = Mamba1Mixer(cfg)
    assert set(ours.state_dict()) == set(hf.state_dict())
    ours.load_state_dict(hf.state_dict(), strict=True)
    x = _x(T=37)
    with torch.no_grad():
        assert rel_err(ours(x), hf(x)) < 1e-5


@pytest.mark.skipif(HF_KERNELS, reason="transformers would pick the CUDA kernels")
def test_parity_transformers_falcon_mamba() -> None:
    """Weightless norms with their own epsilon; the HF norms' dummy buffers are not saved."""
    from transformers import FalconMambaConfig
    from transformers.models.falcon_mamba.modeling_falcon_mamba import FalconMambaMixer

    hf_cfg = FalconMambaConfig(hidden_size=32, state_size=8, conv_kernel=4, intermediate_size=64,
                               time_step_rank=6, mixer_rms_eps=1e-3, num_hidden_layers=1,
                               vocab_size=16, use_bias=False)
    hf = FalconMambaMixer(hf_cfg, layer_idx=0, initialize_mixer_weights=False).eval()
    randomize(hf, seed=4)
    cfg = ModelConfig(pattern="S", d_model=32, mamba1=Mamba1Config(
        d_inner=64, d_state=8, dt_rank=6, inner_norms="weightless",
        inner_norm_eps=1e-3))
    ours = Mamba1Mixer(cfg)
    ours.load_state_dict(hf.state_dict(), strict=True)
    x = _x(T=21)
    with torch.no_grad():
        assert rel_err(ours(x), hf(x)) < 1e-5
        ours.norm_eps = 1e-6  # the epsilon is wired: a wrong one shows
        assert rel_err(ours(x), hf(x)) > 1e-5


def test_keys_shapes_and_init() -> None:
    cfg = _cfg(proj_bias=True)
    with torch.device("meta"):
        mixer = Mamba1Mixer(cfg)
    mixer.to_empty(device="cpu")
    mixer.reset_parameters(torch.Generator().manual_seed(0))
    shapes = {k: tuple(v.shape) for k, v in mixer.state_dict().items()}
    assert shapes == {"in_proj.weight": (96, 32), "in_proj.bias": (96,),
                      "conv1d.weight": (48, 1, 4), "conv1d.bias": (48,),
                      "x_proj.weight": (17, 48), "dt_proj.weight": (48, 5), "dt_proj.bias": (48,),
                      "A_log": (48, 6), "D": (48,), "out_proj.weight": (32, 48),
                      "out_proj.bias": (32,), "dt_layernorm.weight": (5,),
                      "b_layernorm.weight": (6,), "c_layernorm.weight": (6,)}
    m = cfg.mamba1
    assert torch.equal(mixer.A_log.detach(), torch.log(torch.arange(1.0, 7.0)).expand(48, 6))
    dt = F.softplus(mixer.dt_proj.bias.detach())
    assert dt.min() >= m.dt_min * (1 - 1e-5) and dt.max() <= m.dt_max * (1 + 1e-5)
    assert mixer.dt_proj.weight.abs().max() <= 5 ** -0.5
    assert torch.equal(mixer.D.detach(), torch.ones(48))
    assert torch.equal(mixer.c_layernorm.weight.detach(), torch.ones(6))
    assert mixer.in_proj.bias_x.abs().max() == 0
    assert Mamba1Mixer.keep_fp32 == ("A_log",)
    model = build_model(_model_cfg(), dtype=torch.bfloat16, device="meta")
    assert model.layers["0"].mixer.A_log.dtype == torch.float32


def test_kind_record_and_tp_refusal() -> None:
    from composer.build.registry import REGISTRY

    cfg = _model_cfg()
    kind = REGISTRY["S"]
    assert (kind.name, kind.section) == ("Mamba-1", "mamba1")
    assert kind.context_strategy(cfg) == ("halo_conv", "state_passing")
    assert kind.halo_width(cfg) == 3 and kind.decoding_state is Mamba1Mixer.init_cache
    assert ModelConfig(pattern="S-", d_model=64).mamba1 == Mamba1Config(d_inner=128, dt_rank=4)
    with pytest.raises(LayoutError) as err:
        check_model(resolve_layout(ParallelConfig(tp=2), world_size=2), cfg)
    assert str(err.value) == ("Mamba-1 (symbol 'S') has no tensor-parallel form: x_proj reads "
                              "every inner channel, so channels split over tp (2) would need an "
                              "all-reduce inside the mixer; use --tp 1")
    check_model(resolve_layout(ParallelConfig(cp=2), world_size=2), cfg)


def test_config_errors() -> None:
    with pytest.raises(ConfigError, match="mamba1.d_state must be positive, got 0"):
        ModelConfig(pattern="S", mamba1=Mamba1Config(d_state=0)).validate()
    with pytest.raises(ConfigError, match=r"mamba1.dt_min \(0.5\) must be positive and <= "
                                          r"dt_max \(0.1\)"):
        ModelConfig(pattern="S", mamba1=Mamba1Config(dt_min=0.5)).validate()
    with pytest.raises(ConfigError, match="pattern symbol 'S' needs the 'mamba1' section"):
        ModelConfig(pattern="S", mamba1=None).validate()


def test_flops_per_token() -> None:
    # d_model 32, E 48, R 5, N 6, K 4, no bias: projections 32*96 + 48*17 + 5*48 + 48*32
    # = 5664 -> 11328; conv 2*48*4 = 384; scan 5*48*6 + 2*48 = 1536.
    assert Mamba1Mixer.flops_per_token(_cfg(), 64) == 11328 + 384 + 1536
    # with bias: (32 + 1) * 96 + (48 + 1) * 32 adds 96 + 32 params; any length alike
    assert Mamba1Mixer.flops_per_token(_cfg(proj_bias=True), 7) == 11328 + 256 + 384 + 1536


def test_model_trains_and_bf16() -> None:
    cfg = _model_cfg()
    model = build_model(cfg, seed=4)
    ids = torch.randint(0, 61, (4, 24), generator=torch.Generator().manual_seed(5))
    losses = adamw_losses(model, ids, 25)
    assert losses[-1] < 0.5 * losses[0], losses
    mixer = _mixer(_cfg())
    with torch.no_grad():
        y32 = mixer(_x())
        mixer.to(torch.bfloat16)
        mixer.A_log.data = mixer.A_log.data.float()
        y16 = mixer(_x().bfloat16())
    assert y16.dtype == torch.bfloat16 and rel_err(y16.float(), y32) < 0.05


def test_stats_count_the_kind() -> None:
    stats = composer.model_stats(build_model(_model_cfg(), device="meta"), seq_len=16)
    # in_proj, conv1d (+ bias), x_proj, dt_proj (+ bias), A_log, D, out_proj, the three norms
    mixer = 32 * 96 + 48 * 4 + 48 + 48 * 16 + 4 * 48 + 48 + 48 * 6 + 48 + 48 * 32 + 4 + 6 + 6
    assert stats.params_by_kind["S Mamba-1"] == 2 * (mixer + 32)
    assert stats.layer_counts == {"S": 2, "*": 1, "-": 1}


# ---------------------------------------------------------------- the mamba_ssm wrapper


def _fake_mamba_ssm(calls: list):
    """A stand-in for mamba_ssm's ``selective_scan_fn`` in its layouts (our recurrence)."""

    def selective_scan_fn(u, delta, A, B, C, D=None, z=None, delta_bias=None,
                          delta_softplus=False, return_last_state=False):
        calls.append((tuple(u.shape), tuple(B.shape), z, delta_softplus))
        assert A.dtype == torch.float32 and delta_bias.dtype == torch.float32
        dt = delta.transpose(1, 2).float() + delta_bias
        dt = F.softplus(dt) if delta_softplus else dt
        y, h = selective_scan_ref(u.transpose(1, 2).float(), dt, A, B.transpose(1, 2).float(),
                                  C.transpose(1, 2).float(), D_E=D, return_final_state=True)
        y = y.transpose(1, 2).to(u.dtype)
        return (y, h) if return_last_state else y

    return type("ssi", (), {"selective_scan_fn": staticmethod(selective_scan_fn)})


def test_kernel_wrapper_translates_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list = []
    monkeypatch.setattr(ss.probe, "on_gpu", lambda t: True)
    monkeypatch.setattr(ss.probe, "available", lambda name: name == "selective_scan")
    monkeypatch.setattr(ss.probe, "module", lambda name: _fake_mamba_ssm(calls))
    x, dt, A, B, C, D, h0 = (t.float() for t in _inputs())
    bias = torch.randn(6)
    kw = dict(D_E=D, dt_bias_E=bias, dt_softplus=True)
    y, h = ss.selective_scan(x, dt, A, B, C, 8, **kw, return_final_state=True)
    assert calls == [((2, 6, 37), (2, 5, 37), None, True)]
    y_ref, h_ref = selective_scan_torch(x, dt, A, B, C, 8, **kw, return_final_state=True)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h, h_ref, atol=1e-5, rtol=1e-5)
    # documents and start states: the kernel has neither, the torch path runs
    ss.selective_scan(x, dt, A, B, C, 8, **kw, doc_ids=DOCS)
    ss.selective_scan(x, dt, A, B, C, 8, **kw, initial_state_BEN=h0)
    assert len(calls) == 1


def test_cpu_never_probes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ss.probe, "available",
                        lambda name: pytest.fail("a CPU tensor probed a kernel"))
    x, dt, A, B, C, D, _ = (t.float() for t in _inputs(T=5))
    ss.selective_scan(x, dt, A, B, C, 8, D_E=D)
    assert math.isfinite(float(ss.selective_scan(x, dt, A, B, C, 8).sum()))
