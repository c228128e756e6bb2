"""gpt-oss (GptOssForCausalLM): HF -> composer -> HF on logits (fp32, within 1e-4 of
transformers; measured at most 1.1e-6 over three seeds, 19 and 48 tokens) and bytes (fp32 and
bf16, bit for bit), transformers' reload of the export, greedy generation against
``transformers.generate``, MXFP4 expert tensors (dequantised exactly on import; missing scales
refused; the export plain), the config forms and refusals. Preset parameter counts against
transformers' class on meta are in tests/zoo/test_presets.py."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import composer
from composer.config import ConfigError
from composer.convert import from_hf, to_hf
from composer.convert.derived import dequantize_mxfp4, quantize_mxfp4
from composer.convert.gpt_oss import GptOssAdapter
from composer.portable import CheckpointError
from tests.helpers import FP32_PARITY, assert_greedy_equals_hf, hf_to_ours, load_hf, rel_err

TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
COMMON = dict(vocab_size=97, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, intermediate_size=32, num_local_experts=4,
              num_experts_per_tok=2, sliding_window=6, swiglu_limit=1.5,
              max_position_embeddings=256, layer_types=TYPES)


def gpt_oss(randomize, seed: int = 0, **kw) -> torch.nn.Module:
    from transformers import GptOssConfig, GptOssForCausalLM

    model = GptOssForCausalLM(GptOssConfig(**{**COMMON, **kw})).eval()
    randomize(model, seed=seed)
    return model


@pytest.mark.parametrize("kw", [
    dict(),  # yarn RoPE from GptOssConfig's defaults (factor 32, not truncated)
    dict(layer_types=["full_attention"] * 4, rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0}, num_experts_per_tok=1),
], ids=["yarn-sliding", "full-default-rope-top1"])
def test_gpt_oss(check_family, randomize, tmp_path, kw):
    model = gpt_oss(randomize, seed=3, **kw)
    cfg = check_family(model)
    types = kw.get("layer_types", TYPES)
    assert cfg.pattern == "".join("WE" if t == "sliding_attention" else "*E" for t in types)
    a, e = cfg.attention, cfg.moe
    assert (a.sinks, a.qkv_bias, a.out_bias, a.d_head) == (True, True, True, 16)
    assert a.window == (6 if "sliding_attention" in types else None)
    assert (e.score_func, e.router_bias, e.expert_bias, e.swiglu_limit, e.swiglu_alpha) == \
        ("topk_softmax", True, True, 1.5, 1.702)
    assert not cfg.tie_embeddings
    src = json.loads((tmp_path / "hf" / "config.json").read_text())
    back = json.loads((tmp_path / "back" / "config.json").read_text())
    assert back == src  # field for field


def test_logits_parity_is_measured(randomize, tmp_path):
    """A longer input than the window, where the clamps bite; measured below."""
    model = gpt_oss(randomize, seed=4)
    ours = hf_to_ours(model, tmp_path)
    ids = torch.randint(0, 97, (3, 48), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        err = rel_err(ours(ids), model(ids).logits)
    assert err < FP32_PARITY / 10, err


def test_greedy_generation_equals_transformers(randomize, tmp_path):
    """Prefill then one token per step, past the window (ring caches of 6 slots)."""
    model = gpt_oss(randomize, seed=5)
    ours = hf_to_ours(model, tmp_path)
    assert_greedy_equals_hf(model, ours, 97, 20)


# ---------------------------------------------------------------- MXFP4


def exact_fp4(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """FP4 values times one power of two per block of 32: exactly representable."""
    gen = torch.Generator().manual_seed(seed)
    lut = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    values = lut[torch.randint(0, 8, shape, generator=gen)]
    values = values * (torch.randint(0, 2, shape, generator=gen) * 2 - 1)
    exponent = torch.randint(-8, 3, (*shape[:-1], shape[-1] // 32, 1), generator=gen)
    return (values.view(*shape[:-1], -1, 32) * torch.exp2(exponent.float())).view(shape)


def test_mxfp4_round_trip_is_exact():
    x = exact_fp4((3, 5, 64), seed=0)
    blocks, scales = quantize_mxfp4(x)
    assert blocks.dtype == scales.dtype == torch.uint8
    assert blocks.shape == (3, 5, 2, 16) and scales.shape == (3, 5, 2)
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(dequantize_mxfp4(blocks, scales, dtype), x.to(dtype))
    # transformers' own dequantisation reads the same bytes the same way
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    assert torch.equal(theirs, x.transpose(1, 2))


def mxfp4_folder(randomize, tmp_path, drop: str | None = None, flat: bool = False):
    """A tiny gpt-oss checkpoint whose experts are exactly representable, stored as the Hub
    stores them: MXFP4 blocks and scales, ``quantization_config``; and its plain twin."""
    model = gpt_oss(randomize, seed=6, hidden_size=64, intermediate_size=32)
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            ex = layer.mlp.experts
            ex.gate_up_proj.copy_(exact_fp4((4, 64, 64), 10 + i).transpose(1, 2) / 8)
            ex.down_proj.copy_(exact_fp4((4, 64, 32), 20 + i).transpose(1, 2) / 8)
    model.save_pretrained(tmp_path / "plain")
    tensors = load_file(tmp_path / "plain" / "model.safetensors")
    for name in [n for n in tensors if n.endswith(("gate_up_proj", "down_proj"))]:
        # on disk: rows = output features ([E, 2F, D] / [E, D, F]) in blocks of 32 inputs
        blocks, scales = quantize_mxfp4(tensors.pop(name).transpose(1, 2).contiguous())
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
        if flat:  # [E, rows, G * 16], as transformers holds them in memory
            tensors[f"{name}_blocks"] = blocks.flatten(2)
    if drop:
        tensors = {k: v for k, v in tensors.items() if not k.endswith(drop)}
    folder = tmp_path / "mxfp4"
    folder.mkdir()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "plain" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
        "lm_head"]}
    (folder / "config.json").write_text(json.dumps(config))
    return model, folder


@pytest.mark.parametrize("flat", [False, True], ids=["published", "flat-blocks"])
def test_mxfp4_import_dequantises_exactly_and_exports_plain(randomize, tmp_path, flat):
    model, folder = mxfp4_folder(randomize, tmp_path, flat=flat)
    notes = []
    from_hf(folder, tmp_path / "ours", notify=notes.append)
    assert notes == ["8 MXFP4 expert tensors dequantised to float32 on import (exact); the "
                     "export writes them unquantised"]
    from_hf(tmp_path / "plain", tmp_path / "ours_plain")
    ours, plain = (load_file(tmp_path / d / "model.safetensors") for d in ("ours", "ours_plain"))
    assert sorted(ours) == sorted(plain)
    for k in ours:
        assert torch.equal(ours[k], plain[k]), k
    out = to_hf(tmp_path / "ours", tmp_path / "back")
    assert "quantization_config" not in out
    back = load_file(tmp_path / "back" / "model.safetensors")
    assert not any(k.endswith(("_blocks", "_scales")) for k in back)
    ids = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(load_hf(tmp_path / "back")(ids).logits,
                           load_hf(tmp_path / "plain")(ids).logits)


@pytest.mark.parametrize("drop,message", [
    ("down_proj_scales", "MXFP4 tensor 'model.layers.0.mlp.experts.down_proj_blocks' comes "
     "without its scales 'model.layers.0.mlp.experts.down_proj_scales'"),
    ("gate_up_proj_blocks", "MXFP4 scales 'model.layers.0.mlp.experts.gate_up_proj_scales' come "
     "without their blocks")])
def test_mxfp4_strictness(randomize, tmp_path, drop, message):
    _, folder = mxfp4_folder(randomize, tmp_path, drop=drop)
    with pytest.raises(CheckpointError) as err:
        from_hf(folder, tmp_path / "ours")
    assert str(err.value) == message


# ---------------------------------------------------------------- config forms and refusals


def test_config_defaults_are_transformers():
    """A config.json with only the architecture reads as ``GptOssConfig()`` builds it."""
    cfg = GptOssAdapter().config_from_hf({"architectures": ["GptOssForCausalLM"]})
    assert cfg.pattern == "WE*E" * 18
    a = cfg.attention
    assert (a.n_heads, a.n_kv_heads, a.d_head, a.window, a.rope_theta) == (64, 8, 64, 128, 1.5e5)
    s = a.rope_scaling
    assert (s.rope_type, s.factor, s.original_max_position, s.beta_fast, s.beta_slow,
            s.truncate) == ("yarn", 32.0, 4096, 32.0, 1.0, False)
    assert (cfg.moe.n_experts, cfg.moe.top_k, cfg.moe.d_ff) == (128, 4, 2880)


def test_refusals():
    cfg = GptOssAdapter().config_from_hf({**COMMON, "architectures": ["GptOssForCausalLM"]})
    cfg.attention.sinks = False
    cfg.moe.expert_bias = False
    with pytest.raises(ConfigError) as err:
        GptOssAdapter().config_to_hf(cfg, {})
    assert str(err.value) == ("gpt-oss cannot express this model; it needs attention.sinks=true, "
                              "moe.expert_bias=true")
    cfg.pattern = "WE*-"
    with pytest.raises(ConfigError, match="every layer must be 'WE' or '\\*E'"):
        GptOssAdapter().config_to_hf(cfg, {})


def test_packed_documents_equal_documents_alone():
    """gpt-oss-debug (windowed and full attention with sinks, the gpt-oss MoE): two documents
    packed in one row (positions restart, attention isolated) give each one's logits alone."""
    from composer.zoo import get_preset

    model = composer.build_model(get_preset("gpt-oss-debug").config(), seed=0).double().eval()
    ids = torch.randint(0, 512, (1, 21), generator=torch.Generator().manual_seed(0))
    doc_ids = torch.tensor([[0] * 12 + [1] * 9])  # longer than the window of 8
    with torch.no_grad():
        packed = model(ids, doc_ids=doc_ids)
        alone = torch.cat([model(ids[:, :12]), model(ids[:, 12:])], dim=1)
    torch.testing.assert_close(packed, alone, rtol=0, atol=1e-10)


def test_mxfp4_dequantises_to_the_configs_dtype(randomize, tmp_path):
    """The published configs say ``"torch_dtype": "bfloat16"``: the experts come out bf16 (FP4
    values times powers of two are exact there), the other tensors keep their own dtype."""
    _, folder = mxfp4_folder(randomize, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config.pop("dtype", None)
    config["torch_dtype"] = "bfloat16"
    (folder / "config.json").write_text(json.dumps(config))
    notes = []
    from_hf(folder, tmp_path / "ours", notify=notes.append)
    assert "dequantised to bfloat16" in notes[0]
    from_hf(tmp_path / "plain", tmp_path / "ours_plain")
    ours, plain = (load_file(tmp_path / d / "model.safetensors") for d in ("ours", "ours_plain"))
    for k in ours:
        if ".experts." in k and not k.endswith("_bias"):
            assert ours[k].dtype == torch.bfloat16 and torch.equal(ours[k].float(), plain[k]), k
        else:
            assert ours[k].dtype == plain[k].dtype, k
