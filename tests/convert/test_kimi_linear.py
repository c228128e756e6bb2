"""Kimi Linear (KimiLinearForCausalLM): HF -> composer -> HF on logits (fp32, within 1e-4 of
transformers) and bytes (fp32 and bf16, bit for bit), transformers' reload of the export,
greedy generation against ``transformers.generate``, the config forms (the published
``linear_attn_config`` / ``num_experts`` names or ``layer_types`` / ``mlp_layer_types``; MoE
experts per expert or fused on disk; the dense MLP under ``mlp.`` or ``block_sparse_moe.``) and
refusals. Preset parameter counts against transformers' class on meta are in
tests/zoo/test_presets.py with the other families'."""

from __future__ import annotations

import json

import pytest
import torch

import composer
from composer.config import ConfigError
from composer.convert import from_hf, infer_adapter, to_hf
from composer.convert.kimi_linear import KimiLinearAdapter
from composer.zoo import get_preset
from tests.helpers import FP32_PARITY, assert_greedy_equals_hf, hf_to_ours, load_hf, rel_err

LIN = {"head_dim": 8, "num_heads": 2, "short_conv_kernel_size": 4, "kda_layers": [1, 2, 4],
       "full_attn_layers": [3]}
COMMON = dict(vocab_size=97, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
              num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16,
              q_lora_rank=None, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
              num_experts=4, num_experts_per_token=2, num_shared_experts=1,
              first_k_dense_replace=1, pad_token_id=0, bos_token_id=1, eos_token_id=2,
              linear_attn_config=LIN)


def kimi(randomize, seed: int = 0, **kw) -> torch.nn.Module:
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    model = KimiLinearForCausalLM(KimiLinearConfig(**{**COMMON, **kw})).eval()
    randomize(model, seed=seed)  # the correction bias too: it must change the chosen experts
    with torch.no_grad():  # a decay in (0, 1) per channel, as trained models have
        for layer in model.model.layers:
            gate = getattr(layer.self_attn, "forget_gate", None)
            if gate is not None:
                gate.A_log.copy_(torch.rand(gate.A_log.shape).add(1).log())
    return model


@pytest.mark.parametrize("kw", [
    dict(),
    dict(q_lora_rank=12, routed_scaling_factor=1.5, moe_renormalize=False, num_experts=6,
         num_expert_group=2, topk_group=1, tie_word_embeddings=True),  # (never tied)
    dict(mlp_layer_types=["sparse", "dense", "sparse", "dense"],
         layer_types=["full_attention", "linear_attention", "linear_attention",
                      "full_attention"])], ids=["published", "q-lora-groups-tied", "types"])
def test_kimi_linear(check_family, randomize, kw):
    cfg = check_family(kimi(randomize, seed=10 + len(kw), **kw))
    assert cfg.pattern == {0: "K-KE+EKE", 7: "K-KE+EKE", 2: "+EK-KE+-"}[len(kw)]
    k, m, e = cfg.kda, cfg.mla, cfg.moe
    assert (k.n_heads, k.d_head, k.d_conv, k.norm_eps) == (2, 8, 4, 1e-5)
    assert (m.rope, m.q_lora_rank, m.kv_lora_rank, m.norm_eps) == (
        False, kw.get("q_lora_rank"), 16, 1e-6)
    assert (e.n_experts, e.top_k, e.n_shared_experts, e.score_func) == (
        kw.get("num_experts", 4), 2, 1, "sigmoid")
    assert (e.renormalize, e.routed_scaling_factor) == (kw.get("moe_renormalize", True),
                                                        kw.get("routed_scaling_factor", 2.446))


def test_logits_parity_is_measured(randomize, tmp_path):
    """On 64 tokens (two of our 32-token KDA chunks, one of transformers' 64) the fp32 distance
    to transformers stays below 1e-4 (measured 1.2e-5 with one thread and 6.0e-5 with two: the
    reductions' order changes with the thread count; against the fp64 model ours is off by 5e-6
    and transformers' by 1e-5 with one thread, so the gap is the two fp32 roundings)."""
    model = kimi(randomize, seed=3)
    ours = hf_to_ours(model, tmp_path)
    ids = torch.randint(0, 97, (3, 64), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        err = rel_err(ours(ids), model(ids).logits)
    assert err < FP32_PARITY, err


@pytest.mark.slow
def test_greedy_generation_equals_transformers(randomize, tmp_path):
    """``composer.generate`` (prefill, then one step of the delta rule and the latent cache per
    token) gives transformers' greedy tokens, 20 new ones after prompts of 3 and 9."""
    model = kimi(randomize, seed=5)
    ours = hf_to_ours(model, tmp_path)
    assert_greedy_equals_hf(model, ours, 97, 20)


def test_saved_forms_are_read(randomize, tmp_path):
    """The Hub's dense ``mlp.`` prefix, and the experts fused as transformers holds them
    (``mlp.experts.gate_up_proj``), convert like what ``save_pretrained`` writes."""
    from safetensors.torch import load_file, save_file

    model = kimi(randomize, seed=30)
    model.save_pretrained(tmp_path / "hf")
    path = tmp_path / "hf" / "model.safetensors"
    saved = load_file(path)
    assert "model.layers.0.block_sparse_moe.gate_proj.weight" in saved
    hub = {k.replace("layers.0.block_sparse_moe.", "layers.0.mlp."): v for k, v in saved.items()}
    save_file(hub, path, metadata={"format": "pt"})
    from_hf(tmp_path / "hf", tmp_path / "ours")
    to_hf(tmp_path / "ours", tmp_path / "back")
    assert "model.layers.0.mlp.gate_proj.weight" in load_file(tmp_path / "back" /
                                                              "model.safetensors")
    memory = {k: v.clone() for k, v in model.state_dict().items()
              if "conv1d" not in k and "forget_gate" not in k}
    memory.update({k: v for k, v in saved.items() if "conv1d" in k or ".A_log" in k
                   or "f_a_proj" in k or "f_b_proj" in k or "dt_bias" in k})
    assert "model.layers.1.mlp.experts.gate_up_proj" in memory
    save_file(memory, path, metadata={"format": "pt"})
    from_hf(tmp_path / "hf", tmp_path / "fused")
    ids = torch.randint(0, 97, (2, 13), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = model(ids).logits
        for folder in ("ours", "fused"):
            assert rel_err(composer.load(tmp_path / folder)(ids), want) < FP32_PARITY


def test_preset_built_here_is_written_as_kimi_linear(tmp_path):
    """A model built from the preset (no HF source) is inferred as Kimi Linear and reloads in
    transformers with our logits; its config.json has the published fields."""
    preset = get_preset("kimi-linear-debug")
    assert infer_adapter(preset.config()).family == "kimi-linear"
    model = composer.build_model(preset.config(), seed=0)
    composer.save(model, tmp_path / "ck", family=preset.family)
    to_hf(tmp_path / "ck", tmp_path / "hf")
    hf_cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert hf_cfg["linear_attn_config"] == {"kda_layers": [1, 2, 3], "full_attn_layers": [4],
                                            "num_heads": 2, "head_dim": 16,
                                            "short_conv_kernel_size": 4}
    assert (hf_cfg["mla_use_nope"], hf_cfg["num_experts"], hf_cfg["first_k_dense_replace"]) == (
        True, 8, 1)
    ids = torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert rel_err(model(ids), load_hf(tmp_path / "hf")(ids).logits) < FP32_PARITY


@pytest.mark.parametrize(("change", "message"), [
    ({"mla.rope": True}, "Kimi Linear cannot express this model; it needs mla.rope=false"),
    ({"tie_embeddings": True}, "Kimi Linear cannot express this model; it needs "
                               "tie_embeddings=false (transformers never ties them)"),
    ({"kda.d_gate": 4}, "Kimi Linear cannot express this model; it needs kda.d_gate=null "
                        "(d_head)"),
    ({"pattern": "K-K*"}, "pattern 'K-K*' cannot be written as kimi-linear: every layer must "
                          "be 'K' (Kimi delta attention) or '+' (MLA), then '-' or 'E'")])
def test_refusals(change, message):
    cfg = get_preset("kimi-linear-debug").config()
    cfg = composer.apply_overrides(cfg, [f"{k}={str(v).lower() if isinstance(v, bool) else v}"
                                         for k, v in change.items()])
    with pytest.raises(ConfigError) as exc:
        KimiLinearAdapter().config_to_hf(cfg, {})
    assert str(exc.value) == message


@pytest.mark.parametrize(("change", "message"), [
    ({"moe_layer_freq": 2}, "config.json: moe_layer_freq other than 1 is not supported "
                            "(transformers ignores it)"),
    ({"mla_use_nope": False}, "config.json: mla_use_nope=false: transformers' KimiLinear MLA "
                              "applies no RoPE"),
    ({"moe_router_activation_func": "softmax"}, "config.json: moe_router_activation_func must "
                                                "be 'sigmoid' (what transformers runs)"),
    ({"linear_attn_config": {**LIN, "gate_lower_bound": -5.0}},
     "config.json: linear_attn_config fields ['gate_lower_bound'] are not read by "
     "transformers' KimiLinear")])
def test_config_refusals(change, message):
    with pytest.raises(ConfigError) as exc:
        KimiLinearAdapter().config_from_hf({**COMMON, **change})
    assert str(exc.value) == message
