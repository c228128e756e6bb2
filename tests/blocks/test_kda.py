"""Kimi delta attention: the per-channel delta rule chunked == recurrent (fp64 1e-10, states,
documents), gradients (fp64 1e-9), against transformers' own KDA functions (fp32), the block's
plain-math twin (fp64 1e-10), parity with transformers' ``KimiLinearDeltaAttention`` (each
fp32 output within 2e-4 of our fp64 block), packed documents equal documents alone, cached
decoding equals the full forward, init, FLOPs and fla's ``chunk_kda`` wrapper."""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch
import torch.nn.functional as F

import composer
from composer.blocks.kda import KimiDeltaAttention, kda_ref
from composer.config import ConfigError, KDAConfig, ModelConfig
from composer.kernels import gdn as gdn_kernels
from composer.kernels.gdn import gdn_chunked, gdn_end_state, gdn_recurrent_ref, gdn_step
from tests.helpers import adamw_losses, randomize, rel_err

F64 = torch.float64
HF_KERNELS = importlib.util.find_spec("fla") is not None
FLA_REASON = "flash-linear-attention is installed: transformers would run its CUDA kernels"
DOCS = torch.tensor([[0] * 10 + [1] * 20 + [2] * 7, [4] * 37])


def _inputs(b=2, T=37, H=3, K=8, dtype=F64, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(b, T, H, K, generator=g, dtype=dtype), dim=-1)
    k = F.normalize(torch.randn(b, T, H, K, generator=g, dtype=dtype), dim=-1)
    v = torch.randn(b, T, H, K, generator=g, dtype=dtype)
    gate = -2 * torch.rand(b, T, H, K, generator=g, dtype=dtype)  # one decay per key channel
    beta = torch.rand(b, T, H, generator=g, dtype=dtype)
    S0 = torch.randn(b, H, K, K, generator=g, dtype=dtype)
    out = [q, k, v, gate, beta, S0]
    return [t.requires_grad_() for t in out] if grad else out


@pytest.mark.parametrize("chunk", [1, 5, 8, 37])
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


def test_per_channel_decay_is_not_per_head() -> None:
    """The trailing ``K`` reaches the state: a decay that differs across channels differs from
    its per-head mean (guards against a broadcast that silently drops the channel axis)."""
    q, k, v, g, beta, _ = _inputs()
    o = gdn_chunked(q, k, v, g, beta, 8)
    o_head = gdn_chunked(q, k, v, g.mean(-1), beta, 8)
    assert (o - o_head).abs().max() > 1e-2


def test_end_state_and_steps() -> None:
    """The cp carry ``(S_local, M)`` and the decode step hold for a per-channel decay."""
    q, k, v, g, beta, S0 = _inputs()
    local, M = gdn_end_state(q, k, v, g, beta, 8)
    _, S_ref = gdn_recurrent_ref(q, k, v, g, beta, initial_state_BHKV=S0, return_final_state=True)
    torch.testing.assert_close(M @ S0 + local, S_ref, atol=1e-10, rtol=0)
    state = S0.clone()
    steps = torch.cat([gdn_step(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], g[:, t:t + 1],
                                beta[:, t:t + 1], state) for t in range(q.shape[1])], 1)
    o_ref = gdn_recurrent_ref(q, k, v, g, beta, initial_state_BHKV=S0)
    torch.testing.assert_close(steps, o_ref, atol=1e-10, rtol=0)
    torch.testing.assert_close(state, S_ref, atol=1e-10, rtol=0)


@pytest.mark.parametrize("docs", [False, True])
def test_gradients_match_recurrence_fp64(docs: bool) -> None:
    doc_ids = DOCS if docs else None
    inputs = _inputs(T=21, grad=True)
    doc_ids = doc_ids[:, :21] if docs else None
    w = torch.randn(2, 21, 3, 8, dtype=F64, generator=torch.Generator().manual_seed(9))
    wS = torch.randn(2, 3, 8, 8, dtype=F64, generator=torch.Generator().manual_seed(10))
    grads = []
    for fn in (lambda *a: gdn_chunked(*a[:5], 8, initial_state_BHKV=a[5],
                                      return_final_state=True, doc_ids=doc_ids),
               lambda *a: gdn_recurrent_ref(*a[:5], initial_state_BHKV=a[5],
                                            return_final_state=True, doc_ids=doc_ids)):
        o, S = fn(*inputs)
        grads.append(torch.autograd.grad((o * w).sum() + (S * wS).sum(), inputs))
    for got, want in zip(*grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-9, rtol=0)


@pytest.mark.slow  # importing transformers' module dominates (~3 s)
def test_matches_transformers_functions() -> None:
    """Our recurrence against transformers' recurrent and chunked KDA functions (fp32)."""
    from transformers.models.kimi_linear import modeling_kimi_linear as hf

    q, k, v, g, beta, S0 = _inputs(T=13)
    o_ref, S_ref = gdn_recurrent_ref(q, k, v, g, beta, initial_state_BHKV=S0,
                                     return_final_state=True)
    f32 = [t.float() for t in (q, k, v, g, beta)]
    for fn in (hf.recurrent_kimi_delta_attention, hf.chunk_kimi_delta_attention):
        o, S = fn(*f32[:3], g=f32[3], beta=f32[4], initial_state=S0.float(),
                  output_final_state=True)
        torch.testing.assert_close(o.double(), o_ref, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(S.double(), S_ref, atol=2e-5, rtol=2e-5)


# ---------------------------------------------------------------- the block


def _cfg(n_heads: int = 2, d_head: int = 8, d_gate: int | None = None) -> ModelConfig:
    kda = KDAConfig(n_heads=n_heads, d_head=d_head, d_gate=d_gate, chunk_size=8)
    return ModelConfig(pattern="K", d_model=32, init_std=0.2, kda=kda)


def _mixer(cfg: ModelConfig, seed: int = 0) -> KimiDeltaAttention:
    mixer = KimiDeltaAttention(cfg)
    mixer.reset_parameters(torch.Generator().manual_seed(seed))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in mixer.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)
    return mixer


def _x(T: int = 37, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(2, T, 32, generator=torch.Generator().manual_seed(5), dtype=dtype)


@pytest.mark.parametrize("kwargs", [dict(), dict(n_heads=4, d_head=4, d_gate=6)])
@pytest.mark.parametrize("docs", [False, True])
def test_block_matches_ref_fp64(kwargs: dict, docs: bool) -> None:
    cfg = _cfg(**kwargs)
    mixer = _mixer(cfg).double()
    x = _x(dtype=F64)
    weights = {k: v.detach() for k, v in mixer.state_dict().items()}
    doc_ids = DOCS if docs else None
    with torch.no_grad():
        torch.testing.assert_close(mixer(x, doc_ids=doc_ids), kda_ref(x, weights, cfg, doc_ids),
                                   atol=1e-10, rtol=0)


def test_documents_equal_documents_alone() -> None:
    mixer = _mixer(_cfg()).double()
    x = _x(dtype=F64)
    with torch.no_grad():
        packed = mixer(x, doc_ids=DOCS)
        for lo, hi in ((0, 10), (10, 30), (30, 37)):
            torch.testing.assert_close(packed[:1, lo:hi], mixer(x[:1, lo:hi]), atol=1e-12,
                                       rtol=0)


@pytest.mark.skipif(HF_KERNELS, reason=FLA_REASON)
def test_parity_transformers_kimi_linear() -> None:
    """transformers' layer, its weights renamed into ours (the converter's contract)."""
    from transformers import KimiLinearConfig
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDeltaAttention

    hf_cfg = KimiLinearConfig(hidden_size=32, linear_num_heads=2, linear_head_dim=8,
                              linear_conv_kernel_dim=4, rms_norm_eps=1e-5, num_hidden_layers=1,
                              layer_types=["linear_attention"], vocab_size=16)
    torch.manual_seed(0)
    hf = KimiLinearDeltaAttention(hf_cfg, layer_idx=0).eval()
    with torch.no_grad():
        hf.forget_gate.A_log.copy_(torch.rand(1, 1, 2, 1).add(1).log())
        hf.forget_gate.dt_bias.copy_(torch.randn(16))
    _randomize_hf(hf)
    ours = KimiDeltaAttention(ModelConfig(pattern="K", d_model=32, kda=KDAConfig(
        n_heads=2, d_head=8, chunk_size=8, norm_eps=1e-5)))
    sd = hf.state_dict()
    rename = {"forget_gate.f_a_proj.weight": "f_a_proj.weight",
              "forget_gate.f_b_proj.weight": "f_b_proj.weight",
              "forget_gate.dt_bias": "dt_bias", "o_norm.weight": "norm.weight"}
    mine = {rename.get(k, k): v for k, v in sd.items() if k != "forget_gate.A_log"}
    mine["A_log"] = sd["forget_gate.A_log"].reshape(-1)
    ours.load_state_dict(mine, strict=True)
    x = _x(T=37)
    with torch.no_grad():
        exact = copy.deepcopy(ours).double()(x.double())
        scale = exact.abs().max()
        for name, y in (("ours", ours(x)), ("transformers", hf(x))):
            err = ((y.double() - exact).abs().max() / scale).item()
            assert err < 2e-4, (name, err)


def _randomize_hf(hf: torch.nn.Module) -> None:
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "A_log" in name or "dt_bias" in name:
                continue
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)


def test_keys_shapes_and_init() -> None:
    cfg = _cfg()
    with torch.device("meta"):
        mixer = KimiDeltaAttention(cfg)
    mixer.to_empty(device="cpu")
    mixer.reset_parameters(torch.Generator().manual_seed(0))
    shapes = {k: tuple(v.shape) for k, v in mixer.state_dict().items()}
    assert shapes == {"q_proj.weight": (16, 32), "k_proj.weight": (16, 32),
                      "v_proj.weight": (16, 32), "conv1d.weight": (48, 1, 4),
                      "f_a_proj.weight": (8, 32), "f_b_proj.weight": (16, 8),
                      "A_log": (2,), "dt_bias": (16,), "b_proj.weight": (2, 32),
                      "g_a_proj.weight": (8, 32), "g_b_proj.weight": (16, 8),
                      "norm.weight": (8,), "o_proj.weight": (32, 16)}
    d = cfg.kda
    dt = F.softplus(mixer.dt_bias.detach())
    assert dt.min() >= d.dt_min * (1 - 1e-5) and dt.max() <= d.dt_max * (1 + 1e-5)
    A = torch.exp(mixer.A_log.detach())
    assert A.min() >= d.a_init_range[0] and A.max() <= d.a_init_range[1]
    assert torch.equal(mixer.norm.weight.detach(), torch.ones(8))


def _tiny(pattern: str = "K-K*") -> composer.HybridModel:
    cfg = ModelConfig.from_dict({
        "pattern": pattern, "d_model": 32, "vocab_size": 61,
        "kda": {"n_heads": 2, "d_head": 8, "chunk_size": 4},
        "attention": {"n_heads": 4, "n_kv_heads": 2}, "mlp": {"d_ff": 64}})
    model = composer.build_model(cfg.validate(), seed=0)
    randomize(model, seed=1, std=0.1)
    return model.eval()


def test_cached_decoding_equals_full_forward() -> None:
    """Prompt of 11 (crossing 4-token chunks), then 7 greedy steps: every step's logits equal
    the full forward; a prompt in two pieces equals one prefill; generate agrees uncached."""
    model = _tiny()
    assert model.layers["0"].mixer.A_log.dtype == torch.float32
    ids = torch.randint(0, 61, (2, 11), generator=torch.Generator().manual_seed(7))
    cache = model.new_cache(2, 18)
    seq = ids
    with torch.no_grad():
        logits = model.forward_cached(ids, cache)
        for _ in range(7):
            full = model(seq)[:, -1]
            assert rel_err(logits, full) < 1e-5
            token = logits.argmax(-1)
            seq = torch.cat([seq, token[:, None]], 1)
            logits = model.forward_cached(token[:, None], cache)
        whole = model.forward_cached(ids, model.new_cache(2, 11), last_only=False)
        pieces = model.new_cache(2, 11)
        first = model.forward_cached(ids[:, :6], pieces, last_only=False)
        rest = model.forward_cached(ids[:, 6:], pieces, last_only=False)
    assert rel_err(torch.cat([first, rest], 1), whole) < 1e-5
    assert torch.equal(composer.generate(model, ids, 5), composer.generate(model, ids, 5,
                                                                           use_cache=False))


def test_model_trains() -> None:
    model = composer.build_model(_tiny().config, seed=4)
    ids = torch.randint(0, 61, (4, 24), generator=torch.Generator().manual_seed(5))
    losses = adamw_losses(model, ids, 25)
    assert losses[-1] < 0.5 * losses[0], losses


def test_config_errors_and_defaults() -> None:
    with pytest.raises(ConfigError, match="pattern symbol 'K' needs the 'kda' section"):
        ModelConfig(pattern="K", kda=None).validate()
    cfg = ModelConfig.from_dict({"pattern": "K", "d_model": 512})
    assert cfg.kda.n_heads == 8 and cfg.kda.d_head == 64


def test_flops_per_token() -> None:
    # D 32, H 2, K 8, R 8, d_conv 4, chunk 8: projections 32 * (48 + 2 + 16) + 2 * 8 * 16
    # + 16 * 32 = 2880 -> 5760; conv 2 * 48 * 4 = 384; seq 64, L 8:
    # 2 * (32*8 + 16*8 + 16*8 + 6*64) = 1792.
    assert KimiDeltaAttention.flops_per_token(_cfg(), 64) == 5760 + 384 + 1792


# ---------------------------------------------------------------- the fla wrapper


def _fake_fla_kda(calls: list):
    """A stand-in for fla's ``chunk_kda`` (our recurrence, per cu_seqlens piece)."""

    def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                  cu_seqlens=None):
        calls.append(cu_seqlens)
        assert g.shape == k.shape and g.dtype == torch.float32
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

    return type("fla_kda", (), {"chunk_kda": staticmethod(chunk_kda)})


@pytest.mark.parametrize("docs", [False, True])
def test_kernel_wrapper_picks_chunk_kda(monkeypatch: pytest.MonkeyPatch, docs: bool) -> None:
    calls: list = []
    monkeypatch.setattr(gdn_kernels.probe, "on_gpu", lambda t: True)
    monkeypatch.setattr(gdn_kernels.probe, "available", lambda name: name == "fla_kda")
    monkeypatch.setattr(gdn_kernels.probe, "module", lambda name: _fake_fla_kda(calls))
    q, k, v, g, beta, S0 = (t.float() for t in _inputs())
    doc_ids = DOCS if docs else None
    o, S = gdn_kernels.gated_delta_rule(q, k, v, g, beta, 8, initial_state_BHKV=S0,
                                        return_final_state=True, doc_ids=doc_ids)
    assert len(calls) == 1 and (calls[0] is not None) == docs
    o_ref, S_ref = gdn_chunked(q, k, v, g, beta, 8, initial_state_BHKV=S0,
                               return_final_state=True, doc_ids=doc_ids)
    torch.testing.assert_close(o, o_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(S, S_ref, atol=1e-5, rtol=1e-5)
