"""Multi-latent attention against its plain-math twin (fp64, 1e-10) and against transformers'
DeepseekV3Attention (fp32, 1e-5) with DeepSeek's interleaved RoPE rows permuted on the way in."""

import pytest
import torch

from composer.blocks.mla import MLA, mla_ref, yarn_frequencies
from composer.config import MLAConfig, ModelConfig, YarnScaling

YARN = YarnScaling(factor=4.0, original_max_position=8, beta_fast=32.0, beta_slow=1.0,
                   mscale=0.707, mscale_all_dim=1.0)
CASES = {
    "lora-q": MLAConfig(n_heads=4, q_lora_rank=12, kv_lora_rank=16, d_head_nope=8, d_head_rope=4,
                        d_head_v=6),
    "full-q": MLAConfig(n_heads=4, q_lora_rank=None, kv_lora_rank=16, d_head_nope=8,
                        d_head_rope=6, d_head_v=8),
    "lora-q-yarn": MLAConfig(n_heads=2, q_lora_rank=12, kv_lora_rank=10, d_head_nope=6,
                             d_head_rope=8, d_head_v=4, rope_theta=500.0, rope_scaling=YARN),
    "full-q-yarn-default-mscale": MLAConfig(
        n_heads=2, kv_lora_rank=10, d_head_nope=6, d_head_rope=8, d_head_v=4,
        rope_scaling=YarnScaling(factor=8.0, original_max_position=4, beta_fast=4.0,
                                 truncate=False)),
    # Kimi Linear's NoPE MLA (mla_use_nope): the R channels pass unrotated
    "full-q-nope": MLAConfig(n_heads=2, q_lora_rank=None, kv_lora_rank=16, d_head_nope=8,
                             d_head_rope=4, d_head_v=8, rope=False),
}


def _cfg(m: MLAConfig) -> ModelConfig:
    return ModelConfig(pattern="+", d_model=32, mla=m, attention=None, mamba=None, mlp=None,
                       moe=None)


def _randomize(module: torch.nn.Module, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3 + (p.ndim == 1))


@pytest.mark.parametrize("name", CASES)
def test_mla_matches_reference(name):
    m = CASES[name]
    mla = MLA(_cfg(m)).double()
    _randomize(mla)
    x = torch.randn(2, 11, 32, dtype=torch.float64)
    w = dict(mla.state_dict())
    ref = mla_ref(x, w, m)
    torch.testing.assert_close(mla(x), ref, atol=1e-10, rtol=0)
    doc_ids = torch.tensor([[0] * 4 + [1] * 7, [0] * 6 + [3] * 2 + [4] * 3])
    torch.testing.assert_close(mla(x, doc_ids=doc_ids), mla_ref(x, w, m, doc_ids),
                               atol=1e-10, rtol=0)


def test_mla_documents_are_isolated():
    mla = MLA(_cfg(CASES["lora-q-yarn"])).double()
    _randomize(mla)
    a, b = torch.randn(1, 5, 32, dtype=torch.float64), torch.randn(1, 6, 32, dtype=torch.float64)
    packed = mla(torch.cat([a, b], 1), doc_ids=torch.tensor([[0] * 5 + [1] * 6]))
    torch.testing.assert_close(packed, torch.cat([mla(a), mla(b)], 1), atol=1e-12, rtol=0)


def test_max_dense_len_refuses_longer_sequences():
    import dataclasses

    m = dataclasses.replace(CASES["lora-q"], max_dense_len=6)
    mla = MLA(_cfg(m))
    _randomize(mla)
    plain = MLA(_cfg(CASES["lora-q"]))
    plain.load_state_dict(mla.state_dict())
    x = torch.randn(2, 6, 32)
    torch.testing.assert_close(mla(x), plain(x), atol=0, rtol=0)  # up to the limit: dense MLA
    with pytest.raises(ValueError, match=r"sparse attention \(DeepSeek-V3.2's indexer, top-k 6\)"
                       r" is not built; sequences up to 6 tokens are exact"):
        mla(torch.randn(2, 7, 32))


def test_max_dense_len_holds_under_context_parallelism():
    """The cp variant refuses by the whole rows' length, not this rank's tokens."""
    import dataclasses

    from composer.parallel.context.layout import CPContext
    from composer.parallel.context.variants import variant_factory

    mla = MLA(_cfg(dataclasses.replace(CASES["lora-q"], max_dense_len=6)))
    factory = variant_factory(mla.core)
    assert factory is not None
    mla.core = factory(mla.core, CPContext(group=None, size=2, rank=0, T=8))
    with pytest.raises(ValueError, match="sequence of 8 tokens exceeds mla.max_dense_len=6"):
        mla(torch.randn(1, 4, 32))


def _hf_config(m: MLAConfig, interleave: bool):
    from transformers import DeepseekV3Config

    rope = {"rope_type": "default", "rope_theta": m.rope_theta}
    if m.rope_scaling is not None:
        y = m.rope_scaling
        rope = {"rope_type": "yarn", "rope_theta": m.rope_theta, "factor": y.factor,
                "original_max_position_embeddings": y.original_max_position,
                "beta_fast": y.beta_fast, "beta_slow": y.beta_slow, "truncate": y.truncate}
        rope.update({k: getattr(y, k) for k in ("mscale", "mscale_all_dim")
                     if getattr(y, k) is not None})
    hf = DeepseekV3Config(
        hidden_size=32, num_attention_heads=m.n_heads, num_key_value_heads=m.n_heads,
        q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank, qk_nope_head_dim=m.d_head_nope,
        qk_rope_head_dim=m.d_head_rope, v_head_dim=m.d_head_v, rope_parameters=rope,
        rope_interleave=interleave, max_position_embeddings=64, attention_bias=False,
        n_routed_experts=4, n_group=1, topk_group=1, num_experts_per_tok=2)
    hf._attn_implementation = "eager"
    return hf


def deinterleave(n_rows_before: int, d_rope: int, period: int, total: int) -> torch.Tensor:
    """Row order that takes DeepSeek's pair-interleaved RoPE rows (``x0 y0 x1 y1 ...``) to the
    rotate-half order (``x0 x1 ... y0 y1 ...``) in every block of ``period`` rows."""
    perm = torch.arange(total)
    for start in range(n_rows_before, total, period):
        block = torch.arange(start, start + d_rope)
        perm[start:start + d_rope] = torch.cat([block[0::2], block[1::2]])
    return perm


def ours_from_hf(hf_state: dict, m: MLAConfig, interleave: bool) -> dict:
    names = {"q_a_layernorm": "q_a_norm", "kv_a_proj_with_mqa": "kv_a_proj",
             "kv_a_layernorm": "kv_a_norm"}
    out = {}
    for key, t in hf_state.items():
        mod, leaf = key.rsplit(".", 1)
        out[f"{names.get(mod, mod)}.{leaf}"] = t
    if interleave:
        q = "q_proj.weight" if m.q_lora_rank is None else "q_b_proj.weight"
        d_qk = m.d_head_nope + m.d_head_rope
        out[q] = out[q][deinterleave(m.d_head_nope, m.d_head_rope, d_qk, m.n_heads * d_qk)]
        kv = out["kv_a_proj.weight"]
        out["kv_a_proj.weight"] = kv[deinterleave(m.kv_lora_rank, m.d_head_rope, kv.shape[0],
                                                  kv.shape[0])]
    return out


@pytest.mark.parametrize("interleave", [True, False], ids=["interleaved", "rotate-half"])
@pytest.mark.parametrize("name", [n for n in CASES if CASES[n].rope])
def test_mla_matches_transformers(name, interleave):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3Attention,
        DeepseekV3RotaryEmbedding,
    )

    m = CASES[name]
    hf_cfg = _hf_config(m, interleave)
    hf = DeepseekV3Attention(hf_cfg, layer_idx=0)
    _randomize(hf, seed=3)
    mla = MLA(_cfg(m))
    mla.load_state_dict(ours_from_hf(hf.state_dict(), m, interleave), strict=True)
    assert mla.scale == pytest.approx(hf.scaling, rel=1e-12)
    t = 13
    x = torch.randn(2, t, 32)
    pos = torch.arange(t).unsqueeze(0).expand(2, -1)
    cos, sin = DeepseekV3RotaryEmbedding(hf_cfg)(x, pos)
    mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
    expected = hf(x, position_embeddings=(cos, sin), attention_mask=mask)[0]
    torch.testing.assert_close(mla(x), expected, atol=1e-5, rtol=1e-5)


def test_yarn_frequencies_match_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    m = CASES["lora-q-yarn"]
    hf_cfg = _hf_config(m, True)
    inv_freq, gain = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg, "cpu")
    ours = yarn_frequencies(m.d_head_rope, m.rope_theta, m.rope_scaling)
    torch.testing.assert_close(ours.float(), inv_freq.float(), rtol=1e-6, atol=0)
    assert MLA(_cfg(m)).rotary.gain == pytest.approx(gain, rel=1e-12)


def test_flops_and_plan():
    m = CASES["lora-q"]
    cfg = _cfg(m)
    mla = MLA(cfg)
    weights = sum(p.numel() for n, p in mla.named_parameters() if n.endswith("_proj.weight"))
    q, v = m.d_head_nope + m.d_head_rope, m.d_head_v
    assert MLA.flops_per_token(cfg, 64) == 2 * weights + 2 * m.n_heads * (q + v) * 64
    plan = mla.parallel_plan()
    assert plan.colwise == ("q_b_proj", "kv_b_proj") and plan.rowwise == ("o_proj",)
    assert [r.problem({"tp": 8}) for r in MLA.layout_rules(cfg)] == \
        ["mla.n_heads (4) is not divisible by tp (8)"]


def test_nope_mla_matches_transformers_kimi_linear():
    """Kimi Linear's MLA (no RoPE anywhere; the shared key channels concatenated as they are)
    equals ours with ``mla.rope`` false, its weights under our names (fp32, 1e-5)."""
    from transformers import KimiLinearConfig
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearAttention

    m = CASES["full-q-nope"]
    hf_cfg = KimiLinearConfig(hidden_size=32, num_attention_heads=2, num_key_value_heads=2,
                              q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8,
                              qk_rope_head_dim=4, v_head_dim=8, num_hidden_layers=1,
                              layer_types=["full_attention"], vocab_size=16, pad_token_id=0)
    hf_cfg._attn_implementation = "eager"
    hf = KimiLinearAttention(hf_cfg, layer_idx=0).eval()
    _randomize(hf, 4)
    ours = MLA(_cfg(m))
    rename = {"kv_a_proj_with_mqa.weight": "kv_a_proj.weight",
              "kv_a_layernorm.weight": "kv_a_norm.weight"}
    ours.load_state_dict({rename.get(k, k): v for k, v in hf.state_dict().items()}, strict=True)
    x = torch.randn(2, 9, 32)
    mask = torch.full((9, 9), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        want, _ = hf(x, attention_mask=mask)
        torch.testing.assert_close(ours(x), want, atol=1e-5, rtol=1e-5)
