"""GatedDeltaNet: chunked == recurrent (fp64 1e-10, states, documents), gradients (fp64 1e-9,
gradcheck), the block's plain-math twin, parity with transformers' Qwen3-Next and OLMo-Hybrid
layers (each fp32 output within 2e-4 of our fp64 block: their fused weights split into ours,
the converter contract), a G- model that trains, init, FLOPs and the kernel wrapper's argument
translation."""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch
import torch.nn.functional as F

from composer.blocks.gdn import GatedDeltaNet, gdn_ref
from composer.build.builder import build_model
from composer.config import (
    AttentionConfig,
    ConfigError,
    GDNConfig,
    MLPConfig,
    ModelConfig,
)
from composer.kernels import gdn as gdn_kernels
from composer.kernels.gdn import gdn_chunked, gdn_recurrent_ref
from tests.helpers import adamw_losses

F64 = torch.float64
# transformers picks fla's kernels when it is importable, and those need CUDA.
FLA_REASON = ("flash-linear-attention is installed: transformers would run its CUDA kernels, "
              "not the torch path these CPU comparisons need")
HF_KERNELS = importlib.util.find_spec("fla") is not None


def _inputs(b=2, T=37, G=2, R=2, K=8, V=6, dtype=F64, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    H = G * R
    q = F.normalize(torch.randn(b, T, G, K, generator=g, dtype=dtype), dim=-1)
    k = F.normalize(torch.randn(b, T, G, K, generator=g, dtype=dtype), dim=-1)
    v = torch.randn(b, T, H, V, generator=g, dtype=dtype)
    gate = -2 * torch.rand(b, T, H, generator=g, dtype=dtype)
    beta = torch.rand(b, T, H, generator=g, dtype=dtype)
    S0 = torch.randn(b, H, K, V, generator=g, dtype=dtype)
    out = [q, k, v, gate, beta, S0]
    return [t.requires_grad_() for t in out] if grad else out


DOCS = torch.tensor([[0] * 10 + [1] * 20 + [2] * 7, [4] * 37])


@pytest.mark.parametrize("chunk", [1, 5, 8, 16, 37, 64])
@pytest.mark.parametrize("docs", [False, True])
def test_chunked_equals_recurrent_fp64(chunk: int, docs: bool) -> None:
    q, k, v, g, beta, S0 = _inputs()
    doc_ids = DOCS if docs else None
    o_ref, S_ref = gdn_recurrent_ref(q, k, v, g, beta, initial_state_BHKV=S0,
                                     return_final_state=True, doc_ids=doc_ids)
    o, S = gdn_chunked(q, k, v, g, beta, chunk, initial_state_BHKV=S0, return_final_state=True,
                       doc_ids=doc_ids)
    torch.testing.assert_close(o, o_ref, atol=1e-10, rtol=0)
    torch.testing.assert_close(S, S_ref, atol=1e-10, rtol=0)
    o0 = gdn_chunked(q, k, v, g, beta, chunk, doc_ids=doc_ids)
    torch.testing.assert_close(o0, gdn_recurrent_ref(q, k, v, g, beta, doc_ids=doc_ids),
                               atol=1e-10, rtol=0)


def test_documents_are_independent() -> None:
    """A packed document gives what it gives alone (from zero state); the initial state belongs
    to each row's first document."""
    q, k, v, g, beta, S0 = _inputs()
    o = gdn_chunked(q, k, v, g, beta, 8, initial_state_BHKV=S0, doc_ids=DOCS)
    sl = slice(10, 30)
    alone = gdn_chunked(q[:1, sl], k[:1, sl], v[:1, sl], g[:1, sl], beta[:1, sl], 8)
    torch.testing.assert_close(o[:1, sl], alone, atol=1e-12, rtol=0)
    first = gdn_chunked(q[:1, :10], k[:1, :10], v[:1, :10], g[:1, :10], beta[:1, :10], 8,
                        initial_state_BHKV=S0[:1])
    torch.testing.assert_close(o[:1, :10], first, atol=1e-12, rtol=0)


def test_matches_transformers_functions() -> None:
    """Our reference against transformers' own recurrent function (fp32, its GQA repeat)."""
    from transformers.models.qwen3_next.modeling_qwen3_next import (
        torch_recurrent_gated_delta_rule,
    )

    q, k, v, g, beta, S0 = _inputs()
    o_ref, S_ref = gdn_recurrent_ref(q, k, v, g, beta, initial_state_BHKV=S0,
                                     return_final_state=True)
    o, S = torch_recurrent_gated_delta_rule(*(t.float() for t in (q, k, v)), g=g.float(),
                                            beta=beta.float(), initial_state=S0.float(),
                                            output_final_state=True)
    torch.testing.assert_close(o.double(), o_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(S.double(), S_ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("docs", [False, True])
def test_gradients_match_recurrence_fp64(docs: bool) -> None:
    doc_ids = DOCS if docs else None
    inputs = _inputs(grad=True)
    w = torch.randn(2, 37, 4, 6, dtype=F64, generator=torch.Generator().manual_seed(9))
    wS = torch.randn(2, 4, 8, 6, dtype=F64, generator=torch.Generator().manual_seed(10))
    grads = []
    for fn in (lambda *a: gdn_chunked(*a[:5], 8, initial_state_BHKV=a[5],
                                      return_final_state=True, doc_ids=doc_ids),
               lambda *a: gdn_recurrent_ref(*a[:5], initial_state_BHKV=a[5],
                                            return_final_state=True, doc_ids=doc_ids)):
        o, S = fn(*inputs)
        grads.append(torch.autograd.grad((o * w).sum() + (S * wS).sum(), inputs))
    for got, want in zip(*grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-9, rtol=0)


def test_gradcheck_tiny() -> None:
    q, k, v, g, beta, S0 = _inputs(b=1, T=7, G=1, R=2, K=3, V=2, grad=True)

    def fn(q, k, v, g, beta, S0):
        return gdn_chunked(q, k, v, g, beta, 3, initial_state_BHKV=S0, return_final_state=True)

    assert torch.autograd.gradcheck(fn, (q, k, v, g, beta, S0))


# ---------------------------------------------------------------- the block


def _cfg(n_kv_heads: int | None = 2, allow_neg_eigval: bool = False, conv_bias: bool = False,
         norm_eps: float = 1e-6) -> ModelConfig:
    gdn = GDNConfig(n_heads=4, n_kv_heads=n_kv_heads, d_head_k=8, d_head_v=6, chunk_size=8,
                    allow_neg_eigval=allow_neg_eigval, conv_bias=conv_bias, norm_eps=norm_eps)
    return ModelConfig(pattern="G", d_model=32, init_std=0.2, gdn=gdn)


def _randomize(module: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)


def _mixer(cfg: ModelConfig, seed: int = 0) -> GatedDeltaNet:
    mixer = GatedDeltaNet(cfg)
    mixer.reset_parameters(torch.Generator().manual_seed(seed))
    _randomize(mixer, seed + 1)
    return mixer


def _x(T: int = 37, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(2, T, 32, generator=torch.Generator().manual_seed(5), dtype=dtype)


CASES = [dict(), dict(n_kv_heads=None), dict(n_kv_heads=1, allow_neg_eigval=True),
         dict(conv_bias=True)]


@pytest.mark.parametrize("kwargs", CASES)
@pytest.mark.parametrize("docs", [False, True])
def test_block_matches_ref_fp64(kwargs: dict, docs: bool) -> None:
    cfg = _cfg(**kwargs)
    mixer = _mixer(cfg).double()
    x = _x(dtype=F64)
    weights = {k: v.detach() for k, v in mixer.state_dict().items()}
    doc_ids = DOCS if docs else None
    with torch.no_grad():
        torch.testing.assert_close(mixer(x, doc_ids=doc_ids), gdn_ref(x, weights, cfg, doc_ids),
                                   atol=1e-10, rtol=0)


def test_block_fp32_close_to_ref() -> None:
    cfg = _cfg()
    mixer = _mixer(cfg)
    weights = {k: v.detach().double() for k, v in mixer.state_dict().items()}
    with torch.no_grad():
        y = mixer(_x())
        ref = gdn_ref(_x().double(), weights, cfg)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y.double(), ref, atol=1e-5, rtol=1e-5)


def test_causal() -> None:
    mixer = _mixer(_cfg())
    x = _x()
    x2 = x.clone()
    x2[:, 20:] += torch.randn_like(x2[:, 20:])
    with torch.no_grad():
        y, y2 = mixer(x), mixer(x2)
    torch.testing.assert_close(y2[:, :20], y[:, :20], atol=0, rtol=0)
    assert (y2[:, 20:] - y[:, 20:]).abs().max() > 1e-3


def _hf_qwen3_next(G: int, H: int, K: int, V: int):
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    hf_cfg = Qwen3NextConfig(hidden_size=32, linear_num_key_heads=G, linear_num_value_heads=H,
                             linear_key_head_dim=K, linear_value_head_dim=V,
                             linear_conv_kernel_dim=4, rms_norm_eps=1e-6, num_hidden_layers=1,
                             layer_types=["linear_attention"], vocab_size=16,
                             num_attention_heads=2, num_key_value_heads=1)
    return Qwen3NextGatedDeltaNet(hf_cfg, layer_idx=0).eval()


def split_qwen3_next(sd: dict[str, torch.Tensor], G: int, H: int, K: int,
                     V: int) -> dict[str, torch.Tensor]:
    """Qwen3-Next's fused, per-key-head interleaved projections -> our canonical weights (the
    module docstring's recipe; what a converter does)."""
    R = H // G
    qkvz = sd["in_proj_qkvz.weight"]
    D = qkvz.shape[-1]
    q, k, v, z = qkvz.view(G, 2 * K + 2 * R * V, D).split([K, K, R * V, R * V], dim=1)
    b, a = sd["in_proj_ba.weight"].view(G, 2 * R, D).split([R, R], dim=1)
    out = {f"{n}_proj.weight": t.reshape(-1, D) for n, t in zip("qkvzba", (q, k, v, z, b, a),
                                                                 strict=True)}
    out.update({"conv1d.weight": sd["conv1d.weight"], "A_log": sd["A_log"],
                "dt_bias": sd["dt_bias"], "norm.weight": sd["norm.weight"],
                "o_proj.weight": sd["out_proj.weight"]})
    return out


@pytest.mark.skipif(HF_KERNELS, reason=FLA_REASON)
@pytest.mark.parametrize(("G", "H"), [(2, 4), (2, 2), (1, 4)])
def test_parity_transformers_qwen3_next(G: int, H: int) -> None:
    K, V = 8, 6
    torch.manual_seed(0)  # transformers draws A_log from the global generator
    hf = _hf_qwen3_next(G, H, K, V)
    _randomize(hf, 3)
    cfg = ModelConfig(pattern="G", d_model=32, gdn=GDNConfig(
        n_heads=H, n_kv_heads=G, d_head_k=K, d_head_v=V, chunk_size=8, norm_eps=1e-6))
    ours = GatedDeltaNet(cfg)
    ours.load_state_dict(split_qwen3_next(hf.state_dict(), G, H, K, V), strict=True)
    _matches_exact_math(ours, hf, _x(T=37))


# Error model of the fp32 comparisons with transformers. transformers' torch path computes the
# delta rule in fp32 whatever the input dtype, so the exact reference is our block in fp64
# (itself proven equal to the recurrence to 1e-10 above), and each fp32 output is compared with
# it, never one fp32 result with another. Relative to the largest output (~10 here), the chunked
# rule's fp32 error grows with the chunk length through the intra-chunk triangular solve:
# measured <= 1.5e-5 for transformers' 64-token chunks (about 250 unit roundoffs u = 6e-8) and
# <= 3.2e-6 for ours (8-token chunks), with 1 or 2 threads and any ATen CPU capability. The bound
# 2e-4 leaves over 10x margin; a mis-wired weight (swapped heads, q/k, a missing gate) is off by
# more than 1e-1.
FP32_VS_EXACT = 2e-4


def _matches_exact_math(ours: GatedDeltaNet, hf: torch.nn.Module, x: torch.Tensor) -> None:
    with torch.no_grad():
        exact = copy.deepcopy(ours).double()(x.double())
        scale = exact.abs().max()
        for name, y in (("ours", ours(x)), ("transformers", hf(x))):
            err = ((y.double() - exact).abs().max() / scale).item()
            assert err < FP32_VS_EXACT, (name, err)


@pytest.mark.skipif(HF_KERNELS, reason=FLA_REASON)
def test_parity_transformers_olmo_hybrid() -> None:
    """OLMo-Hybrid: separate projections (g_proj is our z_proj), beta doubled, norm eps 1e-5."""
    from transformers import OlmoHybridConfig
    from transformers.models.olmo_hybrid.modeling_olmo_hybrid import OlmoHybridGatedDeltaNet

    hf_cfg = OlmoHybridConfig(hidden_size=32, linear_num_key_heads=2, linear_num_value_heads=4,
                              linear_key_head_dim=8, linear_value_head_dim=6,
                              linear_conv_kernel_dim=4, linear_allow_neg_eigval=True,
                              num_hidden_layers=2,
                              layer_types=["linear_attention", "full_attention"],
                              vocab_size=16, num_attention_heads=2, num_key_value_heads=1)
    torch.manual_seed(0)
    hf = OlmoHybridGatedDeltaNet(hf_cfg, layer_idx=0).eval()
    _randomize(hf, 4)
    ours = GatedDeltaNet(_cfg(allow_neg_eigval=True, norm_eps=1e-5))
    rename = {"g_proj.weight": "z_proj.weight", "o_norm.weight": "norm.weight"}
    ours.load_state_dict({rename.get(k, k): v for k, v in hf.state_dict().items()}, strict=True)
    _matches_exact_math(ours, hf, _x(T=21))


def test_keys_shapes_and_init() -> None:
    cfg = _cfg()
    with torch.device("meta"):
        mixer = GatedDeltaNet(cfg)
    mixer.to_empty(device="cpu")
    mixer.reset_parameters(torch.Generator().manual_seed(0))
    shapes = {k: tuple(v.shape) for k, v in mixer.state_dict().items()}
    assert shapes == {"q_proj.weight": (16, 32), "k_proj.weight": (16, 32),
                      "v_proj.weight": (24, 32), "z_proj.weight": (24, 32),
                      "b_proj.weight": (4, 32), "a_proj.weight": (4, 32),
                      "conv1d.weight": (56, 1, 4), "A_log": (4,), "dt_bias": (4,),
                      "norm.weight": (6,), "o_proj.weight": (32, 24)}
    d = cfg.gdn
    dt = F.softplus(mixer.dt_bias.detach())
    assert dt.min() >= d.dt_min * (1 - 1e-5) and dt.max() <= d.dt_max * (1 + 1e-5)
    A = torch.exp(mixer.A_log.detach())
    assert A.min() >= d.a_init_range[0] and A.max() <= d.a_init_range[1]
    assert torch.equal(mixer.norm.weight.detach(), torch.ones(6))
    assert abs(mixer.q_proj.weight.std().item() - cfg.init_std) < 0.05
    assert GatedDeltaNet.keep_fp32 == ("A_log", "dt_bias")


def test_gradients_flow_and_bf16() -> None:
    mixer = _mixer(_cfg(conv_bias=True))
    x = _x().requires_grad_()
    mixer(x).square().mean().backward()
    for name, p in [("x", x), *mixer.named_parameters()]:
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name
    with torch.no_grad():
        y32 = mixer(_x())
        mixer.to(torch.bfloat16)
        mixer.A_log.data, mixer.dt_bias.data = mixer.A_log.data.float(), mixer.dt_bias.data.float()
        y16 = mixer(_x().bfloat16())
    assert y16.dtype == torch.bfloat16
    assert (y16.float() - y32).abs().max() / y32.abs().max() < 0.05


def test_model_trains() -> None:
    cfg = ModelConfig(pattern="G-G*", d_model=32, vocab_size=97,
                      gdn=GDNConfig(n_heads=4, n_kv_heads=2, d_head_k=8, d_head_v=8,
                                    chunk_size=8),
                      attention=AttentionConfig(n_heads=4, n_kv_heads=2), mlp=MLPConfig(d_ff=64))
    model = build_model(cfg, seed=4)
    assert model.layers["0"].mixer.A_log.dtype == torch.float32
    ids = torch.randint(0, 97, (4, 32), generator=torch.Generator().manual_seed(5))
    losses = adamw_losses(model, ids, 30)
    assert losses[-1] < 0.5 * losses[0], losses


def test_config_errors() -> None:
    with pytest.raises(ConfigError, match=r"gdn.n_heads \(6\) must be divisible by "
                                          r"gdn.n_kv_heads \(4\)"):
        ModelConfig(pattern="G", gdn=GDNConfig(n_heads=6, n_kv_heads=4)).validate()
    with pytest.raises(ConfigError, match="pattern symbol 'G' needs the 'gdn' section"):
        ModelConfig(pattern="G", gdn=None).validate()
    cfg = ModelConfig.from_dict({"pattern": "G", "gdn": {"n_heads": 4, "d_head_k": 16}})
    assert cfg.gdn.n_heads == 4 and cfg.canonical().mamba is None


def test_flops_per_token() -> None:
    # d_model 32, G 2, H 4, K 8, V 6, d_conv 4, chunk 8: projections 32 * (32 + 48 + 8) + 24 * 32
    # = 3584 -> 7168; conv 2 * 56 * 4 = 448; seq 64, L 8: 4 * (32*8 + 12*8 + 14*8 + 6*48) = 3008.
    assert GatedDeltaNet.flops_per_token(_cfg(), 64) == 7168 + 448 + 3008
    # seq 4: L 4: 4 * (128 + 48 + 56 + 288) = 2080.
    assert GatedDeltaNet.flops_per_token(_cfg(), 4) == 7168 + 448 + 2080


# ---------------------------------------------------------------- the fla wrapper


def _fake_fla(calls: list):
    """A stand-in for fla's ``chunk_gated_delta_rule`` (our recurrence, per cu_seqlens piece)."""

    def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None,
                               output_final_state=False, cu_seqlens=None):
        calls.append(cu_seqlens)
        assert q.shape[2] == v.shape[2] and g.dtype == torch.float32
        if cu_seqlens is None:
            return gdn_recurrent_ref(q, k, v, g, beta, scale, initial_state, True)
        outs, finals = [], []
        for i, (lo, hi) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist(),
                                         strict=True)):
            init = None if initial_state is None else initial_state[i:i + 1]
            o, S = gdn_recurrent_ref(*(t[:, lo:hi] for t in (q, k, v, g, beta)), scale, init,
                                     True)
            outs.append(o)
            finals.append(S)
        return torch.cat(outs, 1), torch.cat(finals, 0)

    return type("fla", (), {"chunk_gated_delta_rule": staticmethod(chunk_gated_delta_rule)})


@pytest.mark.parametrize("docs", [False, True])
def test_kernel_wrapper_translates_arguments(monkeypatch: pytest.MonkeyPatch, docs: bool) -> None:
    calls: list = []
    monkeypatch.setattr(gdn_kernels.probe, "on_gpu", lambda t: True)
    monkeypatch.setattr(gdn_kernels.probe, "available", lambda name: name == "fla")
    monkeypatch.setattr(gdn_kernels.probe, "module", lambda name: _fake_fla(calls))
    q, k, v, g, beta, S0 = (t.float() for t in _inputs())
    doc_ids = DOCS if docs else None
    o, S = gdn_kernels.gated_delta_rule(q, k, v, g, beta, 8, initial_state_BHKV=S0,
                                        return_final_state=True, doc_ids=doc_ids)
    assert len(calls) == 1 and (calls[0] is not None) == docs
    if docs:
        assert calls[0].tolist() == [0, 10, 30, 37, 74]
    o_ref, S_ref = gdn_chunked(q, k, v, g, beta, 8, initial_state_BHKV=S0,
                               return_final_state=True, doc_ids=doc_ids)
    torch.testing.assert_close(o, o_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(S, S_ref, atol=1e-5, rtol=1e-5)


def test_cpu_never_probes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gdn_kernels.probe, "available",
                        lambda name: pytest.fail("a CPU tensor probed a kernel"))
    q, k, v, g, beta, _ = (t.float() for t in _inputs(T=5))
    gdn_kernels.gated_delta_rule(q, k, v, g, beta)
