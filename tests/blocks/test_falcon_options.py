"""Falcon-H1's options of the existing kinds, each off by default: Mamba-2's ``multipliers`` (the
µP ``ssm_multipliers`` on ``[z, x, B, C, dt]``), ``gated_norm`` off, ``norm_before_gate``,
``out_proj_bias``; attention's ``key_multiplier``; the MLP's ``gate_multiplier`` /
``down_multiplier``. Each against its plain-math twin (fp64) and transformers' FalconH1 module
(fp32); a whole ``[M*]-`` model with all of them: packed documents equal documents alone, cached
decoding equals the full forward (fp64), tp=2 and cp=2 equal one process (fp64, gloo)."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

import composer
from composer.blocks.attention import Attention, attention_ref
from composer.blocks.mamba2 import Mamba2Mixer, mamba2_ref
from composer.blocks.mlp import MLP, mlp_ref
from composer.config import AttentionConfig, MambaConfig, MLPConfig, ModelConfig
from tests.helpers import randomize

F64 = torch.float64
HF_KERNELS = any(importlib.util.find_spec(p) for p in ("mamba_ssm", "causal_conv1d"))
MULTS = [0.5, 1.25, 0.75, 1.5, 0.875]
OPTIONS = [
    dict(multipliers=MULTS),
    dict(multipliers=MULTS, gated_norm=False),
    dict(multipliers=MULTS, norm_before_gate=True, out_proj_bias=True),
    dict(gated_norm=False, proj_bias=True, out_proj_bias=False),
]
IDS = ["mults", "no-norm", "norm-before-gate", "in-bias-only"]


def _mamba_cfg(**kw) -> ModelConfig:
    m = MambaConfig(n_heads=4, d_head=8, n_groups=2, d_state=8, chunk_size=8, **kw)
    return ModelConfig(pattern="M", d_model=32, init_std=0.2, mamba=m)


def _x(T: int = 21, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(2, T, 32, generator=torch.Generator().manual_seed(5), dtype=dtype)


@pytest.mark.parametrize("kw", OPTIONS, ids=IDS)
def test_mamba_options_match_the_twin_fp64(kw: dict) -> None:
    cfg = _mamba_cfg(**kw)
    mixer = Mamba2Mixer(cfg)
    randomize(mixer, seed=1)
    mixer = mixer.double()
    keys = set(mixer.state_dict())
    assert ("norm.weight" in keys) == kw.get("gated_norm", True)
    assert ("out_proj.bias" in keys) == kw.get("out_proj_bias", kw.get("proj_bias", False))
    assert ("in_proj.bias" in keys) == kw.get("proj_bias", False)
    x = _x(dtype=F64)
    weights = {k: v.detach() for k, v in mixer.state_dict().items()}
    with torch.no_grad():
        torch.testing.assert_close(mixer(x), mamba2_ref(x, weights, cfg), atol=1e-10, rtol=0)
        # and each option changes the output (none is silently ignored)
        plain = Mamba2Mixer(_mamba_cfg(proj_bias=kw.get("proj_bias", False))).double()
        plain.load_state_dict({k: v for k, v in weights.items() if k in plain.state_dict()},
                              strict=False)
        assert (plain(x) - mixer(x)).abs().max() > 1e-3


@pytest.mark.skipif(HF_KERNELS, reason="transformers would pick the CUDA kernels")
@pytest.mark.parametrize("kw", OPTIONS, ids=IDS)
def test_mamba_options_match_transformers_falcon_h1_mixer(kw: dict) -> None:
    from transformers import FalconH1Config
    from transformers.models.falcon_h1.modeling_falcon_h1 import (
        FalconH1Mixer,
        compute_mup_vector,
    )

    out_bias = kw.get("out_proj_bias", kw.get("proj_bias", False))
    hf_cfg = FalconH1Config(
        hidden_size=32, mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_n_groups=2,
        mamba_d_state=8, mamba_chunk_size=8, mamba_rms_norm=kw.get("gated_norm", True),
        mamba_norm_before_gate=kw.get("norm_before_gate", False),
        mamba_proj_bias=kw.get("proj_bias", False), projectors_bias=out_bias,
        ssm_multipliers=kw.get("multipliers", [1.0] * 5), num_hidden_layers=1, vocab_size=16)
    hf = FalconH1Mixer(hf_cfg, layer_idx=0).eval()
    hf.register_buffer("mup_vector", compute_mup_vector(hf_cfg), persistent=False)
    randomize(hf, seed=2)
    hf.mup_vector.copy_(compute_mup_vector(hf_cfg))
    ours = Mamba2Mixer(_mamba_cfg(**kw))
    ours.load_state_dict(hf.state_dict(), strict=True)
    x = _x(T=29)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), hf(x), atol=1e-5, rtol=1e-5)


def test_key_multiplier_matches_the_twin_fp64() -> None:
    a = AttentionConfig(n_heads=4, n_kv_heads=2, d_head=12, key_multiplier=0.625,
                        qkv_bias=True, out_bias=True)
    cfg = ModelConfig(pattern="*", d_model=32, attention=a)
    attn = Attention(cfg)
    randomize(attn, seed=3)
    attn = attn.double()
    sd = {k: v.detach() for k, v in attn.state_dict().items()}
    w = {name: sd[f"{name}.weight"] for name in ("q_proj", "k_proj", "v_proj", "o_proj")}
    w.update({f"{n[0]}_bias": sd[f"{n}.bias"] for n in ("q_proj", "k_proj", "v_proj", "o_proj")})
    x = _x(T=9, dtype=F64)
    with torch.no_grad():
        torch.testing.assert_close(attn(x), attention_ref(x, w, a, 12), atol=1e-10, rtol=0)
        a.key_multiplier = 1.0
        assert (attention_ref(x, w, a, 12) - attn(x)).abs().max() > 1e-3


def test_mlp_multipliers_match_the_twin_and_transformers() -> None:
    from transformers import FalconH1Config
    from transformers.models.falcon_h1.modeling_falcon_h1 import FalconH1MLP

    cfg = ModelConfig(pattern="-", d_model=32, mlp=MLPConfig(d_ff=48, gate_multiplier=0.75,
                                                             down_multiplier=1.125))
    mlp = MLP(cfg)
    randomize(mlp, seed=4)
    x = _x(T=7)
    sd = {k: v.detach().double() for k, v in mlp.state_dict().items()}
    with torch.no_grad():
        ref = mlp_ref(x.double(), sd["up_proj.weight"], sd["down_proj.weight"], "swiglu",
                      sd["gate_proj.weight"], 0.75, 1.125)
        torch.testing.assert_close(mlp.double()(x.double()), ref, atol=1e-12, rtol=0)
        hf = FalconH1MLP(FalconH1Config(hidden_size=32, intermediate_size=48,
                                        mlp_multipliers=[0.75, 1.125]))
        hf.load_state_dict(mlp.float().state_dict())
        torch.testing.assert_close(mlp(x), hf(x), atol=1e-6, rtol=1e-6)


# ---------------------------------------------------------------- a whole model with all of them

FALCON = {"pattern": "[M*]-[M*]-", "d_model": 32, "vocab_size": 61,
          "embedding_multiplier": 2.0, "logits_scaling": 4.0,
          "attention": {"n_heads": 4, "n_kv_heads": 2, "key_multiplier": 0.625},
          "mlp": {"d_ff": 64, "gate_multiplier": 0.75, "down_multiplier": 1.125},
          "mamba": {"d_state": 8, "d_head": 8, "n_groups": 2, "chunk_size": 4,
                    "multipliers": MULTS, "norm_before_gate": True, "out_proj_bias": True},
          "parallel": {"branches": [{"symbol": "M", "in_multiplier": 0.5, "out_multiplier": 1.25},
                                    {"symbol": "*", "in_multiplier": 2.0,
                                     "out_multiplier": 0.75}]}}


def _model() -> composer.HybridModel:
    model = composer.build_model(ModelConfig.from_dict(FALCON), seed=0)
    randomize(model, seed=3)
    return model.to(F64).eval()


def test_packed_documents_and_cached_decoding() -> None:
    """Packed documents equal documents alone; a prefill then one token per call equals the
    full forward (fp64, 1e-10)."""
    model = _model()
    docs = torch.tensor([[0, 0, 0, 0, 1, 1, 2, 2, 2, 2, 2], [5, 6, 6, 6, 6, 6, 6, 6, 6, 7, 7]])
    ids = torch.randint(0, 61, (2, 11), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        packed = model(ids, doc_ids=docs)
        for r in range(2):
            for d in docs[r].unique():
                cols = (docs[r] == d).nonzero()[:, 0]
                torch.testing.assert_close(packed[r:r + 1, cols], model(ids[r:r + 1, cols]),
                                           rtol=1e-10, atol=1e-10)
        full = model(ids)
        cache = model.new_cache(2, 11)
        got = [model.forward_cached(ids[:, :6], cache, last_only=False)]
        got += [model.forward_cached(ids[:, t:t + 1], cache, last_only=False)
                for t in range(6, 11)]
    torch.testing.assert_close(torch.cat(got, 1), full, rtol=1e-10, atol=1e-10)


DATA = np.random.default_rng(0).integers(0, 61, (8, 16))


def _in_ranks() -> dict:
    from tests.helpers import layout_case

    return {name: layout_case(layout, FALCON, DATA, fp64=True)
            for name, layout in (("tp2", {"tp": 2}), ("cp2", {"cp": 2}))}


@pytest.mark.slow
def test_tp2_cp2_equal_one_process_fp64() -> None:
    """With every option set (the multipliers follow each rank's slice of the projection's
    parts): the eval loss, every gradient and three AdamW steps (two gloo ranks)."""
    from composer.parallel.launch import run_distributed
    from tests.helpers import layout_case

    ranks = run_distributed(_in_ranks, 2)
    ref = layout_case({}, FALCON, DATA, fp64=True)
    for name in ("tp2", "cp2"):
        got = ranks[0][name]
        assert abs(got["eval"] - ref["eval"]) < 1e-10, name
        assert np.allclose(got["losses"], ref["losses"], rtol=1e-10, atol=0), name
        for part in ("grads", "params"):
            held = {**ranks[1][name][part], **got[part]}
            assert held.keys() == ref[part].keys(), (name, part)
            for k, want in ref[part].items():
                err = float((held[k] - want).abs().max())
                assert err < 1e-10, (name, part, k, err)
