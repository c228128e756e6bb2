"""Sliding-window attention (``W``) and learned attention sinks: the fp64 twin, transformers'
gpt-oss attention, packed documents, and the ring-buffer decoding cache."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import composer
from composer import AttentionConfig, ModelConfig
from composer.blocks.attention import Attention, WindowedAttention, attention_ref
from composer.config import ConfigError, apply_overrides, d_head_of
from tests.helpers import randomize, rel_err

CASES = {
    "window": (AttentionConfig(n_heads=4, n_kv_heads=2, window=5), True),
    "window-local-theta-qknorm": (AttentionConfig(n_heads=4, n_kv_heads=2, window=4, qk_norm=True,
                                                  rope_theta=1e6, window_rope_theta=100.0,
                                                  rope_scaling=composer.RopeScaling(
                                                      rope_type="linear", factor=8.0)), True),
    "sinks": (AttentionConfig(n_heads=4, n_kv_heads=2, sinks=True), False),
    "window-sinks": (AttentionConfig(n_heads=4, n_kv_heads=1, window=3, sinks=True), True),
}


def _mixer(a: AttentionConfig, windowed: bool) -> Attention:
    cfg = ModelConfig(pattern="W" if windowed else "*", d_model=32, attention=a).validate()
    attn = (WindowedAttention if windowed else Attention)(cfg).double()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.5 + (p.ndim == 1))
    return attn


def _weights(attn: Attention) -> dict[str, torch.Tensor]:
    w = {n: getattr(attn, n).weight for n in ("q_proj", "k_proj", "v_proj", "o_proj")}
    if attn.qk_norm:
        w["q_norm"], w["k_norm"] = attn.q_norm.weight, attn.k_norm.weight
    if hasattr(attn, "sinks"):
        w["sinks"] = attn.sinks
    return w


@pytest.mark.parametrize("name", CASES)
def test_matches_reference_fp64(name):
    a, windowed = CASES[name]
    attn = _mixer(a, windowed)
    x = torch.randn(2, 13, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    doc = torch.tensor([[0] * 6 + [1] * 7, [0] * 13])
    for doc_ids in (None, doc):
        ref = attention_ref(x, _weights(attn), a, attn.d_head, doc_ids=doc_ids,
                            windowed=windowed)
        torch.testing.assert_close(attn(x, doc_ids=doc_ids), ref, atol=1e-10, rtol=0)


def test_packed_documents_equal_documents_alone():
    attn = _mixer(*CASES["window-sinks"])
    x = torch.randn(1, 12, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    doc = torch.tensor([[0] * 5 + [1] * 7])
    packed = attn(x, doc_ids=doc)
    torch.testing.assert_close(packed[:, :5], attn(x[:, :5]), atol=1e-12, rtol=0)
    torch.testing.assert_close(packed[:, 5:], attn(x[:, 5:]), atol=1e-12, rtol=0)


def test_window_is_local():
    """A query never sees a key ``window`` or more tokens back."""
    attn = _mixer(*CASES["window"])
    x = torch.randn(1, 12, 32, dtype=torch.float64)
    x2 = x.clone()
    x2[:, 3] += 1.0
    d = (attn(x) - attn(x2)).abs().amax(-1)[0]
    assert (d[3:8] > 1e-6).all() and (d[8:] < 1e-12).all() and (d[:3] < 1e-12).all()


@pytest.mark.parametrize("window", [None, 4])
def test_sinks_match_transformers_gpt_oss(window):
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssAttention, GptOssRotaryEmbedding

    hf_cfg = GptOssConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=8, num_hidden_layers=2, sliding_window=window or 4,
                          layer_types=["sliding_attention" if window else "full_attention"] * 2,
                          rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0,
                                           "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                           "truncate": False,
                                           "original_max_position_embeddings": 4096})
    hf_cfg._attn_implementation = "eager"
    hf = GptOssAttention(hf_cfg, 0).eval()
    from composer.convert.base import rope_scaling_from_hf

    a = AttentionConfig(n_heads=4, n_kv_heads=2, d_head=8, rope_theta=150000.0, qkv_bias=True,
                        out_bias=True, sinks=True, window=window,
                        rope_scaling=rope_scaling_from_hf(hf_cfg.rope_parameters))
    ours = _mixer(a, window is not None).float()
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            getattr(hf, name).weight.copy_(getattr(ours, name).weight)
            getattr(hf, name).bias.copy_(getattr(ours, name).bias)
        hf.sinks.copy_(ours.sinks)
    t = 11
    x = torch.randn(2, t, 32, generator=torch.Generator().manual_seed(3))
    pos = torch.arange(t)[None]
    cos_sin = GptOssRotaryEmbedding(hf_cfg)(x, pos)
    i, j = torch.arange(t)[:, None], torch.arange(t)[None]
    allowed = (j <= i) & ((i - j < window) if window else True)
    mask = torch.zeros(t, t).masked_fill(~allowed, float("-inf"))[None, None]
    with torch.no_grad():
        want, _ = hf(x, position_embeddings=cos_sin, attention_mask=mask)
        got = ours(x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


SIZES = {"d_model": 32, "vocab_size": 61, "attention.n_heads": 4, "attention.n_kv_heads": 2,
         "mlp.d_ff": 64, "attention.window": 3}


def tiny(pattern: str, extra: dict | None = None) -> composer.HybridModel:
    cfg = ModelConfig(pattern=pattern)
    apply_overrides(cfg, [f"{k}={str(v).lower()}" for k, v in {**SIZES, **(extra or {})}.items()])
    model = composer.build_model(cfg.validate(), seed=0)
    randomize(model, seed=1, std=0.2)
    return model.eval()


@pytest.mark.parametrize("extra", [{}, {"attention.sinks": True}], ids=["plain", "sinks"])
def test_ring_cache_stays_window_and_equals_full_forward(extra):
    """Decode 4x the window of new tokens after left-padded prompts: every windowed layer's
    cache holds ``window`` slots throughout, and each step's logits equal the full forward."""
    model = tiny("W-*-W-", extra)
    w = model.config.attention.window
    ids = torch.randint(0, 61, (2, 5), generator=torch.Generator().manual_seed(7))
    mask = torch.tensor([[1] * 5, [0, 0, 1, 1, 1]])
    n_new = 4 * w
    cache = model.new_cache(2, 5 + n_new)
    seq, seq_mask = ids, mask
    with torch.no_grad():
        logits = model.forward_cached(ids, cache, attention_mask=mask)
        for _ in range(n_new):
            full = model(seq, doc_ids=seq_mask)[:, -1]
            assert rel_err(logits, full) < 1e-5, rel_err(logits, full)
            for idx in (0, 4):
                assert cache.layers[idx].k_BKSE.shape[2] == w
            token = logits.argmax(-1)
            seq = torch.cat([seq, token[:, None]], 1)
            seq_mask = F.pad(seq_mask, (0, 1), value=1)
            logits = model.forward_cached(token[:, None], cache)
    assert cache.layers[2].k_BKSE.shape[2] == 5 + n_new
    assert torch.equal(composer.generate(model, ids, n_new, attention_mask=mask),
                       composer.generate(model, ids, n_new, attention_mask=mask, use_cache=False))


def test_ring_cache_prompt_in_pieces():
    """Multi-token cached calls that wrap the ring equal one prefill."""
    model = tiny("W-W-", {"attention.sinks": True})
    ids = torch.randint(0, 61, (2, 13), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        whole = model(ids)
        cache = model.new_cache(2, 13)
        parts = [model.forward_cached(ids[:, a:b], cache, last_only=False)
                 for a, b in ((0, 5), (5, 7), (7, 8), (8, 13))]
    assert rel_err(torch.cat(parts, 1), whole) < 1e-5


def test_window_needed_and_flops():
    with pytest.raises(ConfigError, match="'W' \\(sliding-window attention\\) needs "
                                          "attention.window"):
        ModelConfig(pattern="W-", d_model=32).validate()
    cfg = ModelConfig(pattern="W*", d_model=32, attention=AttentionConfig(n_heads=4, window=8))
    cfg.validate()
    assert WindowedAttention.flops_per_token(cfg, 1024) == Attention.flops_per_token(cfg, 8)
    assert d_head_of(cfg) == 8
