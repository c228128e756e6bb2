"""Mamba2 and Nemotron-H: HF -> composer -> HF, logits and bytes; config forms, on-disk layouts,
fp32 router tensors in a bf16 checkpoint, refusals, and the family chosen for a bare config."""

import json
import math
import shutil

import pytest
import torch
from safetensors.torch import save_file

import composer
from composer.config import ConfigError
from composer.convert import from_hf, infer_adapter, to_hf
from composer.convert.mamba2 import Mamba2Adapter
from composer.convert.nemotron_h import NemotronHAdapter
from composer.zoo import get_preset
from tests.helpers import FP32_PARITY, assert_same_tensors, read_all, rel_err


def mamba2_kwargs(**kw):
    base = dict(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_heads=8, head_dim=8,
                expand=2, n_groups=2, state_size=8, chunk_size=8, conv_kernel=4)
    return {**base, **kw}


def nemotron_kwargs(pattern, **kw):
    base = dict(vocab_size=97, hidden_size=32, hybrid_override_pattern=pattern,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48,
                mamba_num_heads=8, mamba_head_dim=8, n_groups=2, ssm_state_size=8, chunk_size=8,
                n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                moe_shared_expert_intermediate_size=24)
    return {**base, **kw}


def nemotron(randomize, pattern, seed=0, **kw):
    from transformers import NemotronHConfig, NemotronHForCausalLM

    model = NemotronHForCausalLM(NemotronHConfig(**nemotron_kwargs(pattern, **kw))).eval()
    randomize(model, seed=seed)
    return model


# ---------------------------------------------------------------- Mamba2


@pytest.mark.parametrize("tied", [False, True])
def test_mamba2(check_family, randomize, tied):
    from transformers import Mamba2Config, Mamba2ForCausalLM

    model = Mamba2ForCausalLM(Mamba2Config(**mamba2_kwargs(tie_word_embeddings=tied)))
    randomize(model, seed=10)
    cfg = check_family(model)  # 19 tokens: the last chunk of 8 is partial
    assert cfg.pattern == "MM" and cfg.tie_embeddings == tied and cfg.init_std == 0.1
    m = cfg.mamba
    assert (m.n_heads, m.d_head, m.n_groups, m.d_state, m.chunk_size) == (8, 8, 2, 8, 8)
    assert m.norm_group_size is None and m.dt_limit == (0.0, math.inf)


def test_mamba2_biases_and_dt_limit(check_family, randomize):
    from transformers import Mamba2Config, Mamba2ForCausalLM

    hf_cfg = Mamba2Config(**mamba2_kwargs(use_bias=True, use_conv_bias=False, n_groups=4,
                                          time_step_limit=(0.5, 2.0), layer_norm_epsilon=1e-6,
                                          time_step_min=0.01, time_step_max=0.2,
                                          time_step_floor=1e-3, num_hidden_layers=3))
    model = Mamba2ForCausalLM(hf_cfg)
    randomize(model, seed=11)
    cfg = check_family(model, bf16=False)
    m = cfg.mamba
    assert m.proj_bias and not m.conv_bias and m.n_groups == 4 and cfg.norm_eps == 1e-6
    assert (m.dt_limit, m.dt_min, m.dt_max, m.dt_init_floor) == ((0.5, 2.0), 0.01, 0.2, 1e-3)


# ---------------------------------------------------------------- Nemotron-H


@pytest.mark.parametrize("bias", [False, True])
def test_nemotron_h_dense(check_family, randomize, bias):
    # time_step_limit (0.3, 1.2) clamps many dt values at both ends: parity proves it is mapped.
    model = nemotron(randomize, "M-M*-M-", seed=12, time_step_limit=(0.3, 1.2),
                     use_bias=bias, mlp_bias=bias, use_conv_bias=not bias)
    cfg = check_family(model)
    assert cfg.pattern == "M-M*-M-" and cfg.moe is None and cfg.attention.position == "none"
    assert cfg.mamba.dt_limit == (0.3, 1.2) and cfg.mamba.proj_bias == bias
    assert cfg.mlp.activation == "relu2" and cfg.mlp.bias == bias


@pytest.mark.parametrize(("groups", "norm"), [(1, True), (2, False)])
def test_nemotron_h_moe(check_family, randomize, tmp_path, groups, norm):
    model = nemotron(randomize, "ME*EM-", seed=13, n_routed_experts=8, routed_scaling_factor=2.5,
                     n_group=groups, topk_group=1, norm_topk_prob=norm)
    cfg = check_family(model)
    moe = cfg.moe
    assert (moe.n_experts, moe.top_k, moe.d_ff, moe.n_shared_experts, moe.d_ff_shared) == \
        (8, 2, 16, 1, 24)
    assert moe.score_func == "sigmoid" and moe.score_correction_bias
    assert (moe.routed_scaling_factor, moe.n_expert_groups, moe.topk_groups) == (2.5, groups, 1)
    assert moe.renormalize == norm
    # The export's config.json is the source's, field for field.
    src, back = (json.loads((tmp_path / d / "config.json").read_text()) for d in ("hf", "back"))
    assert back == src


@pytest.fixture
def saved_moe(tmp_path, randomize):
    model = nemotron(randomize, "ME*EM-", seed=14, routed_scaling_factor=2.5)
    folder = tmp_path / "saved"
    model.save_pretrained(folder)
    ids = torch.randint(0, 97, (2, 13), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        return model, folder, ids, model(ids).logits


def check_logits(folder, dst, ids, expected):
    cfg = from_hf(folder, dst)
    with torch.no_grad():
        assert rel_err(composer.load(dst)(ids), expected) < FP32_PARITY
    return cfg


LAYER_LISTS = {
    "new names": {"layers_block_type": ["linear_attention", "moe", "full_attention", "moe",
                                        "linear_attention", "mlp"]},
    "old names": {"layers_block_type": ["mamba", "moe", "attention", "moe", "mamba", "mlp"]},
    "pattern": {"hybrid_override_pattern": "ME*EM-"},
    "pattern with stages and mtp": {"hybrid_override_pattern": "ME*|EM-/*E",
                                    "num_nextn_predict_layers": 0},
}


@pytest.mark.parametrize("form", list(LAYER_LISTS))
def test_nemotron_h_layer_list_forms(saved_moe, tmp_path, form):
    from transformers import AutoConfig

    _, folder, ids, expected = saved_moe
    src = tmp_path / "hf"
    shutil.copytree(folder, src)
    hf = json.loads((src / "config.json").read_text())
    hf.pop("layers_block_type")
    hf.update(LAYER_LISTS[form])
    (src / "config.json").write_text(json.dumps(hf))
    assert check_logits(src, tmp_path / "ours", ids, expected).pattern == "ME*EM-"
    to_hf(tmp_path / "ours", tmp_path / "back")
    assert_same_tensors(folder, tmp_path / "back")
    written = json.loads((tmp_path / "back" / "config.json").read_text())
    assert written["layers_block_type"] == LAYER_LISTS["new names"]["layers_block_type"]
    loaded = AutoConfig.from_pretrained(tmp_path / "back")
    assert loaded.layers_block_type == written["layers_block_type"]


def test_nemotron_h_model_prefix_layout(saved_moe, tmp_path):
    """transformers 5's in-memory names: ``model.`` prefix, ``embedding.``
    (docs/conversion.md, prefixes)."""
    _, folder, ids, expected = saved_moe
    src = tmp_path / "hf"
    src.mkdir()
    shutil.copy(folder / "config.json", src / "config.json")
    renamed = {k.replace("backbone.", "model.").replace("embeddings.", "embedding."): v
               for k, v in read_all(folder).items()}
    assert "model.embedding.weight" in renamed
    save_file(renamed, str(src / "model.safetensors"), metadata={"format": "pt"})
    check_logits(src, tmp_path / "ours", ids, expected)
    to_hf(tmp_path / "ours", tmp_path / "back")  # the Hub layout
    assert_same_tensors(folder, tmp_path / "back")


def test_nemotron_h_fused_experts_on_disk(saved_moe, tmp_path):
    model, _, ids, expected = saved_moe
    model.save_pretrained(tmp_path / "fused", save_original_format=False)
    on_disk = read_all(tmp_path / "fused")
    assert any(k.endswith("mixer.experts.up_proj") for k in on_disk)
    check_logits(tmp_path / "fused", tmp_path / "ours", ids, expected)
    to_hf(tmp_path / "ours", tmp_path / "back")  # the fused layout is reproduced
    back = read_all(tmp_path / "back")
    canonical = {NemotronHAdapter().normalize(k): v for k, v in on_disk.items()}
    assert sorted(canonical) == sorted(back)
    assert all(torch.equal(canonical[k], back[k]) for k in back)


def test_nemotron_h_bf16_with_fp32_router(saved_moe, tmp_path):
    """As transformers saves a bf16 Nemotron-H MoE: router weight and score bias stay fp32."""
    _, folder, _, _ = saved_moe
    src = tmp_path / "hf16"
    src.mkdir()
    shutil.copy(folder / "config.json", src / "config.json")
    keep = ("gate.weight", "gate.e_score_correction_bias")  # what transformers keeps fp32
    mixed = {k: v if k.endswith(keep) else v.to(torch.bfloat16)
             for k, v in read_all(folder).items()}
    assert sum(v.dtype == torch.float32 for v in mixed.values()) == 4
    save_file(mixed, str(src / "model.safetensors"), metadata={"format": "pt"})
    from_hf(src, tmp_path / "ours")
    ours = read_all(tmp_path / "ours")
    assert ours["layers.1.mixer.router.weight"].dtype == torch.float32
    assert ours["layers.1.mixer.router.score_bias"].dtype == torch.float32
    assert ours["layers.0.mixer.A_log"].dtype == torch.float32  # kept fp32 (bf16 on disk)
    assert ours["layers.0.mixer.in_proj.weight"].dtype == torch.bfloat16
    to_hf(tmp_path / "ours", tmp_path / "back")
    assert_same_tensors(src, tmp_path / "back")
    # An fp32 checkpoint exported with --dtype bfloat16 gives the same file.
    from_hf(folder, tmp_path / "ours32")
    to_hf(tmp_path / "ours32", tmp_path / "back16", dtype=torch.bfloat16)
    assert_same_tensors(src, tmp_path / "back16")


# ---------------------------------------------------------------- refusals and inference


def hf_dict(adapter, **changes):
    if isinstance(adapter, Mamba2Adapter):
        base = dict(mamba2_kwargs(), architectures=["Mamba2ForCausalLM"])
    else:
        base = dict(nemotron_kwargs("ME*-"), architectures=["NemotronHForCausalLM"])
    return {**base, **changes}


@pytest.mark.parametrize(("adapter", "changes", "message"), [
    (Mamba2Adapter(), dict(expand=3), "expand * hidden_size (3 * 32) must equal num_heads * "
                                      "head_dim (8 * 8)"),
    (NemotronHAdapter(), dict(moe_latent_size=16), "moe_latent_size=16: latent MoE"),
    (NemotronHAdapter(), dict(num_nextn_predict_layers=1), "multi-token-prediction layers"),
    (NemotronHAdapter(), dict(tie_word_embeddings=True), "never ties lm_head"),
    (NemotronHAdapter(), dict(attention_bias=True), "NemotronHAttention has no biases"),
    (NemotronHAdapter(), dict(mlp_bias=True), "shared experts biases"),
    (NemotronHAdapter(), dict(n_group=4), "4 experts in 4 groups leave fewer than 2 per group"),
    (NemotronHAdapter(), dict(layers_block_type=["mamba", "mamba2"]),
     "unknown layer type 'mamba2'"),
    (NemotronHAdapter(), dict(hybrid_override_pattern="M*G"), "has symbol 'G'"),
], ids=["expand", "latent", "mtp", "tied", "attention-bias", "mlp-bias-moe", "groups",
        "layer-type", "symbol"])
def test_config_refusals(adapter, changes, message):
    with pytest.raises(ConfigError) as info:
        adapter.config_from_hf(hf_dict(adapter, **changes))
    assert message in str(info.value)


def test_nemotron_h_writes_and_reads_dt_limit_as_time_step_limit():
    cfg = get_preset("nemotron-h-debug").config()
    cfg.mamba.dt_limit = (0.25, math.inf)
    hf = NemotronHAdapter().config_to_hf(cfg, {})
    assert list(hf["time_step_limit"]) == [0.25, math.inf]
    assert hf["time_step_min"] == cfg.mamba.dt_min
    assert NemotronHAdapter().config_from_hf(hf).mamba.dt_limit == (0.25, math.inf)


@pytest.mark.parametrize(("preset", "family"), [
    ("mamba2-debug", "mamba2"), ("nemotron-h-debug", "nemotron-h"),
    ("nemotron-3-nano-debug", "nemotron-h")])
def test_infer_adapter(preset, family):
    cfg = get_preset(preset).config()
    adapter = infer_adapter(cfg)
    assert adapter.family == family
    out = adapter.config_to_hf(cfg, {})
    if family == "nemotron-h":  # the list as 5.24 writes it, and the legacy string for others
        pattern = "".join(cfg.parsed.layers)
        assert out["hybrid_override_pattern"] == pattern
        assert out["num_hidden_layers"] == len(pattern)
        assert [t[0] for t in out["layers_block_type"]] == \
            [{"M": "l", "*": "f", "-": "m", "E": "m"}[s] for s in pattern]
