"""PEFT interoperability: our LoRA adapters <-> a PEFT adapter folder, proven on logits against
``peft.PeftModel`` on tiny random Llama, Qwen3, Nemotron-H, LFM2, Jamba, Gemma 3, Kimi Linear and
gpt-oss models (fp32, 1e-4)."""

from __future__ import annotations

import json

import pytest
import torch

import composer
from composer.config import ConfigError
from composer.convert import from_hf
from composer.convert.api import HF_DIR
from composer.convert.infer import adapter_for_architecture
from composer.convert.peft import (
    A_SUFFIX,
    B_SUFFIX,
    LoRATensors,
    link_map,
    load_peft,
    merge,
    read_peft,
    write_peft,
)
from composer.portable import CheckpointError
from tests.helpers import FP32_PARITY, randomize, rel_err

peft = pytest.importorskip("peft")


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=48,
                                        num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2))


def qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(Qwen3Config(vocab_size=97, hidden_size=32, intermediate_size=48,
                                        num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, head_dim=16))


def nemotron_h():
    from transformers import NemotronHConfig, NemotronHForCausalLM

    return NemotronHForCausalLM(NemotronHConfig(
        vocab_size=97, hidden_size=32, hybrid_override_pattern="M*-M", num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, intermediate_size=48, mamba_num_heads=8,
        mamba_head_dim=8, n_groups=2, ssm_state_size=8, chunk_size=8))


def lfm2():
    from transformers import Lfm2Config, Lfm2ForCausalLM

    return Lfm2ForCausalLM(Lfm2Config(
        vocab_size=97, hidden_size=32, intermediate_size=48, block_auto_adjust_ff_dim=False,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        layer_types=["conv", "full_attention"]))


def jamba():
    from transformers import JambaConfig, JambaForCausalLM

    return JambaForCausalLM(JambaConfig(
        vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, attn_layer_period=2, attn_layer_offset=1,
        num_experts=1, mamba_d_state=8, mamba_dt_rank=4))


def gpt_oss():
    from transformers import GptOssConfig, GptOssForCausalLM

    return GptOssForCausalLM(GptOssConfig(
        vocab_size=97, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=4))


def gemma3():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    return Gemma3ForCausalLM(Gemma3TextConfig(
        vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"]))


def kimi_linear():
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    return KimiLinearForCausalLM(KimiLinearConfig(
        vocab_size=97, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=2, kv_lora_rank=16, q_lora_rank=None,
        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, num_experts=4,
        num_experts_per_token=2, pad_token_id=0, linear_attn_config={
            "head_dim": 8, "num_heads": 2, "kda_layers": [1], "full_attn_layers": [2]}))


def falcon_h1():
    from transformers import FalconH1Config, FalconH1ForCausalLM

    return FalconH1ForCausalLM(FalconH1Config(
        vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, mamba_d_ssm=32,
        mamba_n_heads=4, mamba_n_groups=2, mamba_d_state=8, mamba_chunk_size=8,
        mamba_rms_norm=True, ssm_multipliers=[0.5, 1.5, 0.7, 1.1, 0.9], key_multiplier=0.6,
        ssm_out_multiplier=0.5))


FAMILIES = {"llama": llama, "qwen3": qwen3, "nemotron-h": nemotron_h, "lfm2": lfm2,
            "jamba": jamba, "gemma3": gemma3, "kimi-linear": kimi_linear, "gpt-oss": gpt_oss,
            "falcon-h1": falcon_h1}
# Our module names per family: attention q/v, an MLP projection, Mamba-2's fused in_proj,
# the short convolution's in_proj (fused b/c/u) and out_proj, Mamba-1's in_proj ([x; z]),
# x_proj and out_proj (peft refuses no Jamba module); gpt-oss's attention (with biases and sinks
# beside the adapted weights; its routed experts' 3-D weights are not PEFT modules).
TARGETS = {"llama": ("q_proj", "v_proj", "down_proj"), "qwen3": ("q_proj", "k_proj", "up_proj"),
           "nemotron-h": ("in_proj", "q_proj", "o_proj", "up_proj"),
           "lfm2": ("in_proj", "out_proj", "o_proj", "gate_proj"),
           "jamba": ("in_proj", "x_proj", "out_proj", "v_proj", "gate_proj"),
           "gemma3": ("q_proj", "o_proj", "up_proj"),
           "kimi-linear": ("q_proj", "o_proj", "g_a_proj", "b_proj", "kv_b_proj"),
           "gpt-oss": ("q_proj", "k_proj", "v_proj", "o_proj"),
           "falcon-h1": ("in_proj", "q_proj", "o_proj", "up_proj")}
PEFT_TARGETS = {"llama": ["q_proj", "v_proj", "gate_proj", "down_proj"],
                "qwen3": ["k_proj", "v_proj", "o_proj", "down_proj"],
                "nemotron-h": ["in_proj", "v_proj", "down_proj"],
                "lfm2": ["in_proj", "out_proj", "v_proj", "w2"],
                "jamba": ["in_proj", "x_proj", "out_proj", "v_proj", "down_proj"],
                "gemma3": ["k_proj", "v_proj", "gate_proj", "down_proj"],
                "kimi-linear": ["q_proj", "v_proj", "g_b_proj", "kv_a_proj_with_mqa", "o_proj"],
                "gpt-oss": ["q_proj", "v_proj", "o_proj"],
                "falcon-h1": ["in_proj", "v_proj", "down_proj"]}


@pytest.fixture(params=list(FAMILIES))
def converted(request, tmp_path):
    """(family, HF model (random, fp32), our checkpoint folder, its config, its link map)."""
    hf_model = FAMILIES[request.param]().eval()
    randomize(hf_model, seed=3)
    if request.param == "falcon-h1":  # its mup_vector is config, rebuilt on load
        from transformers.models.falcon_h1.modeling_falcon_h1 import compute_mup_vector

        with torch.no_grad():
            for layer in hf_model.model.layers:
                layer.mamba.mup_vector.copy_(compute_mup_vector(hf_model.config))
    hf_model.save_pretrained(tmp_path / "hf")
    cfg = from_hf(tmp_path / "hf", tmp_path / "ours")
    arch = json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"][0]
    adapter = adapter_for_architecture(arch)
    return request.param, hf_model, tmp_path / "ours", adapter, link_map(adapter, cfg)


def random_lora(lmap, names, seed=0) -> LoRATensors:
    """Adapters of mixed ranks and scalings (B nonzero) on every 2-D weight named ``names``."""
    g = torch.Generator().manual_seed(seed)
    lora = LoRATensors({}, {})
    for i, (key, shape) in enumerate(sorted(lmap.our_shapes.items())):
        base = key.removesuffix(".weight")
        if len(shape) != 2 or base.rsplit(".", 1)[-1] not in names:
            continue
        r = 2 + i % 3
        lora.tensors[base + A_SUFFIX] = torch.randn(r, shape[1], generator=g) * 0.3
        lora.tensors[base + B_SUFFIX] = torch.randn(shape[0], r, generator=g) * 0.3
        lora.scalings[base] = (4.0, 8.0)[i % 2] / r
    assert lora.bases()
    return lora


def ours_logits(folder, lora, ids):
    model = composer.load(folder).eval()
    model.load_state_dict(merge(model.state_dict(), lora))
    with torch.no_grad():
        return model(ids)


def ids_for(vocab=97):
    return torch.randint(0, vocab, (2, 13), generator=torch.Generator().manual_seed(1))


def test_export_loads_in_peft(converted, tmp_path):
    family, hf_model, folder, adapter, lmap = converted
    lora = random_lora(lmap, TARGETS[family])
    write_peft(tmp_path / "adapter", lmap, lora, base_model=str(tmp_path / "hf"))
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM"
    assert config["rank_pattern"] and config["bias"] == "none"
    ids = ids_for()
    model = peft.PeftModel.from_pretrained(hf_model, tmp_path / "adapter").eval()
    with torch.no_grad():
        expected = model(ids).logits
    got = ours_logits(folder, lora, ids)
    assert rel_err(got, expected) < FP32_PARITY, rel_err(got, expected)
    with torch.no_grad(), model.disable_adapter():  # the adapter is not a no-op
        assert rel_err(model(ids).logits, expected) > 1e-2


def test_peft_made_adapter_imports(converted, tmp_path):
    family, hf_model, folder, adapter, lmap = converted
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=PEFT_TARGETS[family],
                             rank_pattern={"v_proj": 2}, alpha_pattern={"down_proj": 3})
    model = peft.get_peft_model(hf_model, config).eval()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    model.save_pretrained(tmp_path / "made")
    ids = ids_for()
    with torch.no_grad():
        expected = model(ids).logits
    lora = load_peft(tmp_path / "made", lmap, adapter)
    assert len(lora.bases()) == len(read_peft(tmp_path / "made")[1]) // 2
    got = ours_logits(folder, lora, ids)
    assert rel_err(got, expected) < FP32_PARITY, rel_err(got, expected)


def test_round_trip_is_exact(converted, tmp_path):
    family, _, _, adapter, lmap = converted
    lora = random_lora(lmap, TARGETS[family], seed=7)
    write_peft(tmp_path / "adapter", lmap, lora, base_model="base")
    back = load_peft(tmp_path / "adapter", lmap, adapter)
    assert sorted(back.tensors) == sorted(lora.tensors)
    for key, t in lora.tensors.items():
        assert torch.equal(back.tensors[key], t), key
    assert back.scalings == pytest.approx(lora.scalings, rel=1e-12)


def stacked_lmap():
    """Granite's shared MLP: our gate_proj and up_proj are the halves of one HF input_linear."""
    from composer.convert.peft import LinkMap
    from composer.convert.plan import Link

    links = [Link("m.gate_proj.weight", "hf.input_linear.weight", (), ((0, 6),)),
             Link("m.up_proj.weight", "hf.input_linear.weight", (), ((6, 12),))]
    return LinkMap({"m.gate_proj.weight": links[:1], "m.up_proj.weight": links[1:]},
                   {"hf.input_linear.weight": links}, {"m.gate_proj.weight": (6, 5),
                                                       "m.up_proj.weight": (6, 5)},
                   {"hf.input_linear.weight": (12, 5)}, "granite")


def test_one_hf_module_from_two_of_ours_is_rank_stacked(tmp_path):
    lmap = stacked_lmap()
    g = torch.Generator().manual_seed(0)
    lora = LoRATensors({"m.gate_proj.lora.A.weight": torch.randn(2, 5, generator=g),
                        "m.gate_proj.lora.B.weight": torch.randn(6, 2, generator=g),
                        "m.up_proj.lora.A.weight": torch.randn(3, 5, generator=g),
                        "m.up_proj.lora.B.weight": torch.randn(6, 3, generator=g)},
                       {"m.gate_proj": 2.0, "m.up_proj": 0.5})
    write_peft(tmp_path / "a", lmap, lora, base_model=None)
    config, tensors = read_peft(tmp_path / "a")
    a = tensors["base_model.model.hf.input_linear.lora_A.weight"]
    b = tensors["base_model.model.hf.input_linear.lora_B.weight"]
    assert a.shape == (5, 5) and b.shape == (12, 5) and config["r"] == 5
    delta = config["lora_alpha"] / config["r"] * b @ a
    want = torch.cat([2.0 * lora.b("m.gate_proj") @ lora.a("m.gate_proj"),
                      0.5 * lora.b("m.up_proj") @ lora.a("m.up_proj")])
    assert torch.allclose(delta, want, atol=1e-5)
    back = load_peft(tmp_path / "a", lmap, adapter_for_architecture("LlamaForCausalLM"))
    for base in ("m.gate_proj", "m.up_proj"):  # each gets the HF module's A (exact delta)
        got = back.scalings[base] * back.b(base) @ back.a(base)
        assert torch.allclose(got, lora.scalings[base] * lora.b(base) @ lora.a(base),
                              atol=1e-5)


def test_fused_ours_from_hf_modules_with_different_a_is_block_diagonal(tmp_path):
    """The inverse: one of ours from two HF modules whose A's differ (a PEFT adapter on Qwen3.5's
    in_proj_qkv halves, say): the stacked A, the block-diagonal B, exact."""
    from composer.convert.peft import LinkMap, from_peft
    from composer.convert.plan import Link

    links = [Link("m.fused.weight", "hf.a.weight", ((0, 4),), ()),
             Link("m.fused.weight", "hf.b.weight", ((4, 10),), ())]
    lmap = LinkMap({"m.fused.weight": links}, {"hf.a.weight": links[:1],
                                               "hf.b.weight": links[1:]},
                   {"m.fused.weight": (10, 5)}, {"hf.a.weight": (4, 5), "hf.b.weight": (6, 5)},
                   "x")
    g = torch.Generator().manual_seed(1)
    t = {f"base_model.model.hf.{m}.lora_{x}.weight": torch.randn(*s, generator=g)
         for m, shapes in (("a", {"A": (2, 5), "B": (4, 2)}), ("b", {"A": (2, 5), "B": (6, 2)}))
         for x, s in shapes.items()}
    config = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "alpha_pattern": {"hf.b": 1}}
    lora = from_peft(lmap, config, t)
    assert lora.a("m.fused").shape == (4, 5)
    want = torch.cat([2.0 * t["base_model.model.hf.a.lora_B.weight"]
                      @ t["base_model.model.hf.a.lora_A.weight"],
                      0.5 * t["base_model.model.hf.b.lora_B.weight"]
                      @ t["base_model.model.hf.b.lora_A.weight"]])
    got = lora.scalings["m.fused"] * lora.b("m.fused") @ lora.a("m.fused")
    assert torch.allclose(got, want, atol=1e-5)


@pytest.fixture
def llama_adapter(tmp_path):
    hf_model = llama()
    hf_model.save_pretrained(tmp_path / "hf")
    cfg = from_hf(tmp_path / "hf", tmp_path / "ours")
    adapter = adapter_for_architecture("LlamaForCausalLM")
    lmap = link_map(adapter, cfg)
    write_peft(tmp_path / "adapter", lmap, random_lora(lmap, ("q_proj",)), base_model="b")
    return tmp_path / "adapter", lmap, adapter


def edit(folder, config=None, tensors=None):
    from safetensors.torch import save_file

    if config is not None:
        path = folder / "adapter_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    if tensors is not None:
        save_file(tensors, str(folder / "adapter_model.safetensors"))


@pytest.mark.parametrize("change, message", [
    ({"use_dora": True}, "use_dora=true: DoRA is not supported"),
    ({"use_rslora": True}, "use_rslora=true: rank-stabilised scaling is not supported"),
    ({"bias": "all"}, "bias='all' is not supported"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save=[\"lm_head\"]: modules_to_save is not"),
    ({"peft_type": "IA3"}, "peft_type 'IA3' is not supported"),
])
def test_refused_options(llama_adapter, change, message):
    folder, lmap, adapter = llama_adapter
    edit(folder, config=change)
    with pytest.raises(ConfigError, match=None) as exc:
        load_peft(folder, lmap, adapter)
    assert message in str(exc.value) and "\n" not in str(exc.value)


def test_unknown_module_and_wrong_shape(llama_adapter):
    folder, lmap, adapter = llama_adapter
    _, tensors = read_peft(folder)
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    renamed = {k.replace("self_attn.q_proj", "self_attn.qq_proj"): v for k, v in tensors.items()}
    edit(folder, tensors=renamed)
    with pytest.raises(CheckpointError, match="unknown module 'model.layers.0.self_attn.qq_proj'"):
        load_peft(folder, lmap, adapter)
    wrong = dict(tensors)
    wrong[key] = torch.zeros(wrong[key].shape[0], 31)
    edit(folder, tensors=wrong)
    with pytest.raises(CheckpointError, match=r"shape mismatch: module 'model.layers.0.self_attn"
                                              r".q_proj' has lora_A \[\d+, 31\]"):
        load_peft(folder, lmap, adapter)
    missing = {k: v for k, v in tensors.items() if k != key}
    edit(folder, tensors=missing)
    with pytest.raises(CheckpointError, match="has lora_B but not lora_A"):
        load_peft(folder, lmap, adapter)


@pytest.mark.parametrize("converted", ["nemotron-h"], indirect=True)
def test_mamba_out_proj_refused(converted, tmp_path):
    """peft refuses LoRA on a Mamba mixer's out_proj: the export says so up front."""
    _, _, folder, _, lmap = converted
    assert (folder / HF_DIR / "config.json").exists()
    with pytest.raises(ConfigError, match="peft refuses LoRA on a Mamba mixer's out_proj"):
        write_peft(tmp_path / "a", lmap, random_lora(lmap, ("out_proj",)), base_model=None)
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize("converted", ["gpt-oss"], indirect=True)
def test_routed_expert_adapters_refused(converted, tmp_path):
    """LoRA on the routed experts' 3-D weights (``targets: [experts]``) has no PEFT module: the
    export names the weight and the way out, before writing anything."""
    _, _, _, _, lmap = converted
    lora = random_lora(lmap, ("q_proj",))
    base = next(k for k in lmap.our_shapes if k.endswith("mixer.experts.up_proj"))
    E, F, D = lmap.our_shapes[base]
    lora.tensors |= {f"{base.removesuffix('.up_proj')}.lora.up_proj.A": torch.ones(E, 2, D),
                     f"{base.removesuffix('.up_proj')}.lora.up_proj.B": torch.ones(E, F, 2)}
    with pytest.raises(ConfigError) as err:
        write_peft(tmp_path / "a", lmap, lora, base_model=None)
    assert str(err.value) == (
        f"{base}: routed-expert LoRA (on the 3-D expert weights) is not exported to PEFT: PEFT "
        "adapts those through target_parameters, which this export does not write; export with "
        "--merge")
    assert not (tmp_path / "a").exists()


# ---------------------------------------------------------------- the commands


def peft_made(hf_model, folder, targets=("q_proj", "v_proj", "down_proj"), seed=5):
    """``folder``: a PEFT adapter made by peft itself (random nonzero lora_B); returns the
    PeftModel (eval)."""
    model = peft.get_peft_model(hf_model, peft.LoraConfig(r=4, lora_alpha=8,
                                                          target_modules=list(targets)))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    model.save_pretrained(folder)
    return model.eval()


@pytest.fixture
def llama_hf(tmp_path):
    hf_model = llama().eval()
    randomize(hf_model, seed=4)
    hf_model.save_pretrained(tmp_path / "hf")
    from_hf(tmp_path / "hf", tmp_path / "ours")
    return hf_model


def test_eval_and_generate_load_a_peft_adapter(llama_hf, tmp_path, capsys):
    import numpy as np

    from composer.cli import main
    from composer.cli.generate import load_model

    model = peft_made(llama_hf, tmp_path / "made")
    ids = ids_for()
    np.save(tmp_path / "ids.npy", ids.numpy())
    with torch.no_grad():
        logits = model(ids).logits
    expected = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                 ids[:, 1:].reshape(-1)).item()
    assert main(["eval", str(tmp_path / "ours"), "--tokens", str(tmp_path / "ids.npy"),
                 "--adapter", str(tmp_path / "made"), "--json", "--device", "cpu"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["loss"]
    assert got == pytest.approx(expected, rel=1e-5)
    for source, kind in ((tmp_path / "hf", "hf"), (tmp_path / "ours", "portable")):
        with torch.no_grad():
            out = load_model(source, kind, "cpu", str(tmp_path / "made"))(ids)
        assert rel_err(out, logits) < FP32_PARITY, (kind, rel_err(out, logits))


def test_bad_adapter_on_eval_is_one_line(llama_hf, tmp_path, capsys):
    import numpy as np

    from composer.cli import main

    peft_made(llama_hf, tmp_path / "made")
    edit(tmp_path / "made", config={"use_dora": True})
    np.save(tmp_path / "ids.npy", ids_for().numpy())
    assert main(["eval", str(tmp_path / "ours"), "--tokens", str(tmp_path / "ids.npy"),
                 "--adapter", str(tmp_path / "made"), "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert "use_dora=true: DoRA is not supported" in err and len(err.splitlines()) == 1


def train_run(source, save, **kw):
    from tests.helpers import train_case

    return train_case({"model": str(source), "tokens": "synthetic", "seq_len": 16, "steps": 2,
                       "global_batch_size": 4, "lr": 1e-2, "device": "cpu",
                       "precision": "fp32", "save": str(save), **kw})


def test_export_flags_of_a_run_without_adapters(llama_hf, tmp_path, capsys):
    from composer.cli import main

    train_run(tmp_path / "ours", tmp_path / "run")
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "a"), "--adapter"]) == 2
    assert "not a LoRA run" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "a"), "--base", "x"]) == 2
    assert "--base" in capsys.readouterr().err
    assert not (tmp_path / "a").exists()
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "m"), "--merge"]) == 0
    import numpy as np  # eval --adapter of a run: the same loss as of its export

    peft_made(llama(), tmp_path / "made")
    np.save(tmp_path / "ids.npy", ids_for().numpy())
    capsys.readouterr()
    losses = []
    for source in (tmp_path / "run", tmp_path / "m"):
        assert main(["eval", str(source), "--tokens", str(tmp_path / "ids.npy"), "--adapter",
                     str(tmp_path / "made"), "--json", "--device", "cpu"]) == 0
        losses.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1])["loss"])
    assert losses[0] == losses[1]


def test_lora_run_exports_a_peft_adapter_and_a_merged_checkpoint(llama_hf, tmp_path, capsys):
    from composer.cli import main
    from composer.convert import to_hf

    train_run(tmp_path / "ours", tmp_path / "run", lora_rank=4, lora_alpha=8,
              lora_targets=["q_proj", "v_proj", "down_proj"])
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "plain")]) == 2
    err = capsys.readouterr().err
    assert "--adapter" in err and "--merge" in err and not (tmp_path / "plain").exists()
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "adapter"), "--adapter"]) == 0
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(tmp_path / "ours")
    assert config["r"] == 4 and config["lora_alpha"] == 8
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "merged"), "--merge"]) == 0
    ids = ids_for()
    with torch.no_grad():
        ours = composer.load(tmp_path / "merged").eval()(ids)
        got = peft.PeftModel.from_pretrained(llama_hf, tmp_path / "adapter").eval()(ids).logits
    assert rel_err(got, ours) < FP32_PARITY
    to_hf(tmp_path / "merged", tmp_path / "merged-hf")
    from tests.helpers import load_hf

    with torch.no_grad():
        assert rel_err(load_hf(tmp_path / "merged-hf")(ids).logits, ours) < FP32_PARITY
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "b"), "--adapter",
                 "--base", "meta-llama/x"]) == 0
    assert json.loads((tmp_path / "b" / "adapter_config.json").read_text())[
        "base_model_name_or_path"] == "meta-llama/x"


def test_training_start_reads_the_adapter_for_either_source(llama_hf, tmp_path):
    """What ``train --adapter`` starts from: the same adapter tensors whether SOURCE is the
    Hugging Face folder or its conversion."""
    from composer.convert.peft_folders import training_start

    peft_made(llama_hf, tmp_path / "made")
    a = training_start(tmp_path / "hf", tmp_path / "made")
    b = training_start(tmp_path / "ours", tmp_path / "made")
    assert sorted(a.tensors) == sorted(b.tensors) and a.scalings == b.scalings
    assert all(torch.equal(a.tensors[k], b.tensors[k]) for k in a.tensors)
    assert set(a.ranks().values()) == {4} and set(a.scalings.values()) == {2.0}


def test_plain_export_of_a_run_with_adapters_is_refused(llama_hf, tmp_path, capsys):
    """A run whose checkpoint holds adapter tensors (written here by hand: no LoRA modules
    needed) is not exported without --adapter or --merge: the adapters would be dropped."""
    import shutil

    import torch.distributed.checkpoint as dcp

    from composer.cli import main
    from composer.parallel.checkpoint import latest_step

    train_run(tmp_path / "ours", tmp_path / "run")
    step = latest_step(tmp_path / "run")
    meta = dcp.FileSystemReader(str(step)).read_metadata().state_dict_metadata
    state = {k.removeprefix("model."): torch.empty(m.size, dtype=m.properties.dtype)
             for k, m in meta.items() if k.startswith("model.")}
    dcp.load({"model": state}, checkpoint_id=str(step))
    state["layers.0.mixer.q_proj.lora.A.weight"] = torch.zeros(2, 32)
    shutil.rmtree(step)
    dcp.save({"model": state}, checkpoint_id=str(step))
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert "a LoRA run; a plain export would drop its adapters: use --adapter" in err
    assert len(err.splitlines()) == 1 and not (tmp_path / "out").exists()


def fake_lora_modules(lora: LoRATensors):
    """A stand-in for the glue to composer.lora: plain ``lora.A`` / ``lora.B`` linears under
    each adapted module, so a hand-written checkpoint's adapters are found by name."""
    def install(model, run):
        for base in lora.bases():
            module = model.get_submodule(base)
            module.lora = torch.nn.Module()
            module.lora.A = torch.nn.Linear(1, 1, bias=False, device="meta")
            module.lora.B = torch.nn.Linear(1, 1, bias=False, device="meta")
            module.lora.A.weight = torch.nn.Parameter(torch.empty_like(lora.a(base),
                                                                       device="meta"))
            module.lora.B.weight = torch.nn.Parameter(torch.empty_like(lora.b(base),
                                                                       device="meta"))
        return dict(lora.scalings)
    return install


def test_run_with_adapters_exports_peft_and_merged(llama_hf, tmp_path, monkeypatch):
    """export --adapter and --merge of a run whose checkpoint holds adapters (written by hand,
    the LoRA modules faked): peft's logits with the adapter on the run's trained base equal the
    merged checkpoint's, and the merged checkpoint converts to transformers."""
    import shutil

    import torch.distributed.checkpoint as dcp

    import composer.convert.peft_folders as folders
    from composer.cli import main
    from composer.convert import to_hf
    from composer.parallel.checkpoint import latest_step
    from tests.helpers import load_hf

    train_run(tmp_path / "ours", tmp_path / "run")
    assert folders.run_origin(tmp_path / "run")[1] == tmp_path / "ours"
    to_hf(tmp_path / "run", tmp_path / "base-hf")  # the trained base, before adapters
    step = latest_step(tmp_path / "run")
    meta = dcp.FileSystemReader(str(step)).read_metadata().state_dict_metadata
    state = {k.removeprefix("model."): torch.empty(m.size, dtype=m.properties.dtype)
             for k, m in meta.items() if k.startswith("model.")}
    dcp.load({"model": state}, checkpoint_id=str(step))
    cfg = composer.ModelConfig.load(tmp_path / "run" / "config.yaml")
    lmap = link_map(adapter_for_architecture("LlamaForCausalLM"), cfg)
    lora = random_lora(lmap, ("q_proj", "v_proj", "down_proj"), seed=9)
    state.update(lora.tensors)
    shutil.rmtree(step)
    dcp.save({"model": state}, checkpoint_id=str(step))
    monkeypatch.setattr(folders, "lora_modules", fake_lora_modules(lora))
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "adapter"), "--adapter"]) == 0
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(tmp_path / "ours")
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "merged"), "--merge"]) == 0
    assert not any(".lora." in k for k in composer.load(tmp_path / "merged").state_dict())
    to_hf(tmp_path / "merged", tmp_path / "merged-hf")
    ids = ids_for()
    with torch.no_grad():
        got = peft.PeftModel.from_pretrained(load_hf(tmp_path / "base-hf"),
                                             tmp_path / "adapter").eval()(ids).logits
        merged = composer.load(tmp_path / "merged").eval()(ids)
        base = load_hf(tmp_path / "base-hf")(ids).logits
        merged_hf = load_hf(tmp_path / "merged-hf")(ids).logits
    assert rel_err(got, merged) < FP32_PARITY, rel_err(got, merged)
    assert rel_err(merged_hf, merged) < FP32_PARITY
    assert rel_err(base, merged) > 1e-2  # the adapters are not a no-op


@pytest.mark.parametrize("family", ["qwen3-next", "qwen3.5"])
def test_fused_hf_projections_of_gated_delta_net(family, tmp_path):
    """Qwen3-Next's in_proj_qkvz (and Qwen3.5's in_proj_qkv) is made of four (three) of our
    GDN projections, interleaved by head group: an export stacks their A's and places their
    B's block-diagonally; a peft-made adapter on it gives each of ours its A and B rows."""
    import importlib.util

    if importlib.util.find_spec("fla") is not None:
        pytest.skip("flash-linear-attention is installed: transformers would run CUDA kernels")
    from transformers import (
        Qwen3_5ForCausalLM,
        Qwen3_5TextConfig,
        Qwen3NextConfig,
        Qwen3NextForCausalLM,
    )

    common = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                  linear_value_head_dim=6)
    if family == "qwen3-next":
        hf_model = Qwen3NextForCausalLM(Qwen3NextConfig(
            **common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
            shared_expert_intermediate_size=24))
        fused = "in_proj_qkvz"
    else:
        hf_model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**common))
        fused = "in_proj_qkv"
    hf_model.eval()
    randomize(hf_model, seed=6)
    hf_model.save_pretrained(tmp_path / "hf")
    cfg = from_hf(tmp_path / "hf", tmp_path / "ours")
    adapter = adapter_for_architecture(type(hf_model).__name__)
    lmap = link_map(adapter, cfg)
    lora = random_lora(lmap, ("q_proj", "k_proj", "v_proj", "z_proj"), seed=2)
    write_peft(tmp_path / "adapter", lmap, lora, base_model=None)
    ids = ids_for()
    with torch.no_grad():
        got = peft.PeftModel.from_pretrained(hf_model, tmp_path / "adapter").eval()(ids).logits
    assert rel_err(ours_logits(tmp_path / "ours", lora, ids), got) < FP32_PARITY
    back = load_peft(tmp_path / "adapter", lmap, adapter)
    for base in lora.bases():  # stacked on the way out: the rank grows, the update is exact
        want = lora.scalings[base] * lora.b(base) @ lora.a(base)
        have = back.scalings[base] * back.b(base) @ back.a(base)
        assert torch.allclose(have, want, atol=1e-5), base
    hf_model = type(hf_model)(hf_model.config).eval()
    randomize(hf_model, seed=6)
    model = peft_made(hf_model, tmp_path / "made", targets=(fused, "o_proj"))
    with torch.no_grad():
        expected = model(ids).logits
    lora = load_peft(tmp_path / "made", lmap, adapter)
    assert rel_err(ours_logits(tmp_path / "ours", lora, ids), expected) < GDN_LORA_PARITY


GDN_LORA_PARITY = 4e-4
"""The bound for a peft-made adapter (every A and B entry N(0, 0.3^2), so the update of the
fused projection is as large as its weight) on gated delta nets: the larger q, k and gates make
the chunked delta rule's solve worse conditioned than on the base model, and the two sides'
different summation orders (ours: the tap-by-tap CPU convolution, a blocked solve) differ by
7.6e-5 (with torch's mkldnn depthwise convolution) and 1.1e-4 (the tap-by-tap one) on
Qwen3-Next's config here, 5e-6 on Qwen3.5's. 4e-4 keeps 3.5x over the worst measured; a wrong
mapping of the fused projection's rows moves the logits by O(1)."""


def test_train_starts_from_a_peft_adapter(llama_hf, tmp_path):
    """``composer train SOURCE --adapter DIR`` (SOURCE a Hugging Face folder or its portable
    conversion): the run starts as peft's adapted model (its logits at step 0), only the
    adapters train, a resume is exact, and ``export --adapter`` writes what peft loads back."""
    from transformers import LlamaForCausalLM

    from composer.cli import main
    from composer.cli.generate import load_model
    from composer.lora import is_adapter

    made = peft_made(llama_hf, tmp_path / "made")
    ids = ids_for()
    with torch.no_grad():
        want = made(ids).logits
    for source in (tmp_path / "hf", tmp_path / "ours"):
        run = tmp_path / f"run-{source.name}"
        train_run(source, run, steps=0, adapter=str(tmp_path / "made"))
        with torch.no_grad():
            assert rel_err(load_model(run, "training", "cpu")(ids), want) < FP32_PARITY
    straight = train_run(tmp_path / "ours", tmp_path / "straight", adapter=str(tmp_path / "made"))
    train_run(tmp_path / "ours", tmp_path / "resumed", adapter=str(tmp_path / "made"),
              exit_at_step=1)
    resumed = train_case_resume(tmp_path / "resumed")
    start = train_run(tmp_path / "ours", tmp_path / "zero", steps=0, adapter=str(tmp_path / "made"))
    for name, p in straight["params"].items():
        assert torch.equal(p, resumed["params"][name]), name
        assert is_adapter(name) != torch.equal(p, start["params"][name]), name
    assert main(["export", str(tmp_path / "straight"), str(tmp_path / "out"), "--adapter"]) == 0
    base = LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        back = peft.PeftModel.from_pretrained(base, tmp_path / "out").eval()(ids).logits
        ours = load_model(tmp_path / "straight", "training", "cpu")(ids)
    assert rel_err(back, ours) < FP32_PARITY


def train_case_resume(run):
    from tests.helpers import train_case

    return train_case({"exit_at_step": None}, source=str(run))
