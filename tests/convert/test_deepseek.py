"""DeepSeek-V3 (MLA + dense / sigmoid-routed MoE): HF -> composer -> HF, logits and bytes; the
interleaved RoPE rows are permuted on import and restored exactly on export; MTP layers inside
the model (bit-exact round trip, loss against the checkpoint's tensors). DeepSeek-V3.2: the
same up to index_topk tokens, its DSA indexer tensors kept aside byte for byte, longer sequences
refused."""

import pytest
import torch

from composer.config import MOE_TRAINING_ONLY, ConfigError

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0,
        "mscale": 0.707, "mscale_all_dim": 1.0}


def tiny(**kw):
    base = dict(vocab_size=97, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4,
                num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8,
                qk_rope_head_dim=4, v_head_dim=6, n_routed_experts=8, n_group=2, topk_group=1,
                num_experts_per_tok=2, n_shared_experts=1, routed_scaling_factor=2.5,
                max_position_embeddings=256, rope_parameters=YARN, num_nextn_predict_layers=0)
    base.update(kw)
    return base


@pytest.mark.parametrize("q_lora_rank", [16, None], ids=["lora-q", "full-q"])
def test_deepseek_v3(check_family, randomize, q_lora_rank):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    model = DeepseekV3ForCausalLM(DeepseekV3Config(**tiny(q_lora_rank=q_lora_rank)))
    randomize(model, seed=5)
    bias = model.model.layers[1].mlp.gate.e_score_correction_bias
    assert bias.abs().max() > 0  # the score-correction bias is random too
    cfg = check_family(model)
    assert cfg.pattern == "+-+E+E"
    assert cfg.mla.q_lora_rank == q_lora_rank and cfg.mla.rope_scaling.mscale_all_dim == 1.0
    assert (cfg.moe.n_expert_groups, cfg.moe.topk_groups, cfg.moe.routed_scaling_factor) == \
        (2, 1, 2.5)


def test_deepseek_v3_plain_rope_all_moe(check_family, randomize):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    hf = DeepseekV3Config(**tiny(first_k_dense_replace=0, n_group=1, topk_group=1,
                                 n_shared_experts=2, norm_topk_prob=False,
                                 rope_parameters={"rope_type": "default",
                                                  "rope_theta": 5000.0}))
    model = DeepseekV3ForCausalLM(hf)
    randomize(model, seed=6)
    cfg = check_family(model, bf16=False)
    assert cfg.pattern == "+E+E+E" and cfg.moe.n_shared_experts == 2
    assert cfg.mla.rope_scaling is None and not cfg.moe.renormalize


def mtp_checkpoint(folder, n_mtp: int, randomize, dtype=torch.float32):
    """A tiny DeepSeek-V3 checkpoint with ``n_mtp`` MTP layers as the Hub stores them
    (``model.layers.{3 + d}.*``, per-expert MoE, copies of the embedding and head): transformers'
    ``save_pretrained`` writes none, so its ``MtpModel`` (random weights) provides them. Returns
    the HF main model, the MtpModel and the tensors written."""
    from safetensors.torch import load_file, save_file
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    from transformers.modeling_layers import MtpModel

    model = DeepseekV3ForCausalLM(DeepseekV3Config(**tiny(num_nextn_predict_layers=n_mtp)))
    randomize(model, seed=2)
    mtp = MtpModel(model, n_mtp)
    randomize(mtp.layers, seed=3)  # not the embedding and head: they are the main model's
    model.save_pretrained(folder)
    weights = load_file(folder / "model.safetensors")
    for d, layer in enumerate(mtp.layers):
        hf = f"model.layers.{3 + d}"
        for name, t in layer.state_dict().items():
            name = name.removeprefix("mtp_block.").replace("post_norm.", "shared_head.norm.")
            if name.endswith("experts.gate_up_proj"):
                for e in range(t.shape[0]):
                    weights[f"{hf}.mlp.experts.{e}.gate_proj.weight"] = t[e, :16].clone()
                    weights[f"{hf}.mlp.experts.{e}.up_proj.weight"] = t[e, 16:].clone()
            elif name.endswith("experts.down_proj"):
                for e in range(t.shape[0]):
                    weights[f"{hf}.mlp.experts.{e}.down_proj.weight"] = t[e].clone()
            else:
                weights[f"{hf}.{name}"] = t.clone()
        weights[f"{hf}.embed_tokens.weight"] = weights["model.embed_tokens.weight"].clone()
        weights[f"{hf}.shared_head.head.weight"] = weights["lm_head.weight"].clone()
    weights = {k: v.to(dtype) if v.is_floating_point() and not k.endswith(
        ("gate.weight", "e_score_correction_bias")) else v for k, v in weights.items()}
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return model, mtp, weights


@pytest.mark.parametrize("n_mtp,dtype", [(1, torch.float32), (2, torch.float32),
                                         (1, torch.bfloat16)], ids=["D1", "D2", "D1-bf16"])
def test_mtp_layers_round_trip_inside_the_model(tmp_path, randomize, n_mtp, dtype):
    from composer.convert import from_hf, to_hf
    from tests.helpers import assert_same_tensors, read_all

    _, _, weights = mtp_checkpoint(tmp_path / "hf", n_mtp, randomize, dtype)
    cfg = from_hf(tmp_path / "hf", tmp_path / "ours")
    assert cfg.pattern == "+-+E+E" + "/+E" * n_mtp
    assert not (tmp_path / "ours" / "hf" / "aside").exists()  # nothing kept aside
    ours = read_all(tmp_path / "ours")
    assert not any("embed_tokens" in k or "shared_head" in k for k in ours)  # copies consumed
    for d in range(n_mtp):
        eh = weights[f"model.layers.{3 + d}.eh_proj.weight"]  # [e; h] on disk, [h; e] ours
        assert torch.equal(ours[f"mtp.{d}.proj.weight"], torch.cat([eh[:, 32:], eh[:, :32]], 1))
        assert torch.equal(ours[f"mtp.{d}.layers.1.mixer.experts.up_proj"][3],
                           weights[f"model.layers.{3 + d}.mlp.experts.3.up_proj.weight"])
    to_hf(tmp_path / "ours", tmp_path / "back")
    assert_same_tensors(tmp_path / "hf", tmp_path / "back")  # the copies written again
    import json
    assert json.loads((tmp_path / "back" / "config.json").read_text())[
        "num_nextn_predict_layers"] == n_mtp


def test_mtp_loss_equals_a_reference_from_the_hf_tensors(tmp_path, randomize):
    """Our MTP loss on the converted model against the formula written out on the checkpoint's
    own tensors, ``eh_proj`` applied to ``[enorm(e); hnorm(h)]`` as stored, transformers'
    decoder layer for the block."""
    import composer

    model, mtp, w = mtp_checkpoint(tmp_path / "hf", 2, randomize)
    from composer.convert import from_hf

    from_hf(tmp_path / "hf", tmp_path / "ours")
    ours = composer.load(tmp_path / "ours")
    ids = torch.randint(0, 97, (2, 15), generator=torch.Generator().manual_seed(4))
    T = ids.shape[1]

    def rms(x, weight):
        return weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    model.eval()
    assert model.config._attn_implementation == "sdpa"  # no mask: causal
    with torch.no_grad():
        out = ours(ids, ids)
        h = model(ids, output_hidden_states=True).hidden_states[-1]  # after model.norm
        ces = []
        for k in (1, 2):
            hf, n = f"model.layers.{2 + k}", T - k
            e = w["model.embed_tokens.weight"][ids[:, k:]]  # token t + k at position t
            u = torch.cat([rms(e, w[f"{hf}.enorm.weight"]), rms(h[:, :n], w[f"{hf}.hnorm.weight"])],
                          -1) @ w[f"{hf}.eh_proj.weight"].T
            pos = torch.arange(n)[None]
            x = mtp.layers[k - 1].mtp_block(
                u, position_ids=pos, position_embeddings=model.model.rotary_emb(u, pos))
            h = rms(x, w[f"{hf}.shared_head.norm.weight"])
            logp = torch.log_softmax(h @ w["lm_head.weight"].T, -1)[:, :T - k - 1]
            ces.append(-logp.gather(-1, ids[:, k + 1:, None]).mean())
    # a mean of log-softmax values of fp32 logits (FP32_PARITY's error model; log-softmax
    # passes an error with gain <= 2, the mean averages them): the same bound holds
    from tests.helpers import FP32_PARITY

    for got, want in zip(out.mtp_losses, ces, strict=True):
        assert abs(got - want) < FP32_PARITY * want
    assert abs(out.mtp_loss - 0.1 / 2 * (ces[0] + ces[1])) < FP32_PARITY * out.mtp_loss


@pytest.mark.parametrize("copy", ["shared_head.head.weight", "embed_tokens.weight"])
def test_an_mtp_layer_with_its_own_copy_is_kept_aside(tmp_path, randomize, capsys, copy):
    """An MTP layer whose head or embedding differs from the main one (transformers loads such a
    checkpoint: it never reads the layer) cannot be our MTP part, which shares them: the rest
    converts, the layer is kept aside byte for byte with a one-line notice, and the export is
    the source bit for bit."""
    from safetensors.torch import save_file

    from composer.cli import main
    from tests.helpers import assert_same_tensors, read_all

    _, _, weights = mtp_checkpoint(tmp_path / "hf", 1, randomize)
    weights[f"model.layers.3.{copy}"][5, 7] += 1.0
    save_file(weights, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    capsys.readouterr()
    assert main(["convert", "from-hf", str(tmp_path / "hf"), str(tmp_path / "ours")]) == 0
    out, err = capsys.readouterr()
    original = "lm_head.weight" if copy.startswith("shared_head") else "model.embed_tokens.weight"
    n_mtp = sum(k.startswith("model.layers.3.") for k in weights)
    assert err == (f"composer: note: {n_mtp} multi-token-prediction tensors kept aside byte for "
                   "byte in hf/aside/ (written back by to-hf), not converted: model.layers.3."
                   f"{copy} differs from {original}; the model shares one "
                   f"{'lm_head' if copy.startswith('shared') else 'embed'}.weight and cannot hold "
                   "a different copy\n")
    assert out.startswith(f"wrote {tmp_path / 'ours'} (pattern +-+E+E)")
    aside = read_all(tmp_path / "ours" / "hf" / "aside")
    assert sorted(aside) == sorted(k for k in weights if k.startswith("model.layers.3."))
    assert main(["convert", "to-hf", str(tmp_path / "ours"), str(tmp_path / "back")]) == 0
    assert_same_tensors(tmp_path / "hf", tmp_path / "back")


def test_incomplete_mtp_layer_is_kept_aside_and_written_back(tmp_path, randomize):
    from safetensors.torch import load_file, save_file
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from composer.convert import from_hf, to_hf

    model = DeepseekV3ForCausalLM(DeepseekV3Config(**tiny(num_nextn_predict_layers=1)))
    randomize(model)
    model.save_pretrained(tmp_path / "hf")
    weights = load_file(tmp_path / "hf" / "model.safetensors")
    weights["model.layers.3.eh_proj.weight"] = torch.randn(32, 64)  # the rest of it missing
    save_file(weights, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    assert from_hf(tmp_path / "hf", tmp_path / "ours").pattern == "+-+E+E"  # no MTP part
    to_hf(tmp_path / "ours", tmp_path / "back")
    back = load_file(tmp_path / "back" / "model.safetensors")
    assert set(back) == set(weights)
    assert torch.equal(back["model.layers.3.eh_proj.weight"],
                       weights["model.layers.3.eh_proj.weight"])


def test_unsupported_fields_are_refused():
    from composer.convert.deepseek_v3 import DeepseekV3Adapter

    adapter = DeepseekV3Adapter()
    with pytest.raises(ConfigError, match="rope_interleave=false"):
        adapter.config_from_hf(tiny(rope_interleave=False))
    with pytest.raises(ConfigError, match="quantized checkpoints"):
        adapter.config_from_hf(tiny(quantization_config={"quant_method": "fp8"}))


def tiny_v32(**kw):
    base = tiny(index_topk=24, index_n_heads=2, index_head_dim=8)
    base.update(kw)
    return base


@pytest.mark.parametrize("mlp_layer_types", [None, ["sparse", "dense", "sparse"]],
                         ids=["first-k-dense", "mixed"])
def test_deepseek_v32(check_family, randomize, tmp_path, mlp_layer_types):
    from safetensors.torch import load_file
    from transformers import DeepseekV32Config, DeepseekV32ForCausalLM

    import composer

    model = DeepseekV32ForCausalLM(DeepseekV32Config(**tiny_v32(mlp_layer_types=mlp_layer_types)))
    randomize(model, seed=7)
    indexer = model.model.layers[0].self_attn.indexer
    assert indexer.k_norm.bias.abs().max() > 0 and indexer.wq_b.weight.abs().max() > 0
    # 2 x 19 tokens <= index_topk: the indexer selects every causal key, dense MLA is exact
    cfg = check_family(model, bf16=mlp_layer_types is None)
    assert cfg.mla.max_dense_len == 24
    assert cfg.pattern == ("+-+E+E" if mlp_layer_types is None else "+E+-+E")
    aside = load_file(tmp_path / "ours" / "hf" / "aside" / "model.safetensors")
    names = {f"model.layers.{i}.self_attn.indexer.{w}" for i in range(3)
             for w in ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias",
                       "weights_proj.weight")}
    assert set(aside) == names
    back = load_file(tmp_path / "back" / "model.safetensors")
    for name in names:  # written back byte for byte
        assert back[name].dtype == aside[name].dtype and torch.equal(back[name], aside[name])
    import json
    hf_back = json.loads((tmp_path / "back" / "config.json").read_text())
    assert (hf_back["index_topk"], hf_back["index_n_heads"], hf_back["index_head_dim"]) == \
        (24, 2, 8)
    assert "rope_interleave" not in hf_back
    ours = composer.load(tmp_path / "ours")
    ids = torch.randint(0, 97, (1, 25))
    with pytest.raises(ValueError, match=r"sparse attention \(DeepSeek-V3.2's indexer, top-k "
                       r"24\) is not built; sequences up to 24 tokens are exact"):
        ours(ids)
    with torch.no_grad():
        assert ours(ids[:, :24]).shape == (1, 24, 97)


def test_deepseek_v32_refusals():
    from composer.convert.deepseek_v3 import DeepseekV32Adapter

    adapter = DeepseekV32Adapter()
    with pytest.raises(ConfigError, match="needs q_lora_rank"):
        adapter.config_from_hf(tiny_v32(q_lora_rank=None))
    with pytest.raises(ConfigError, match="layer_types"):
        adapter.config_from_hf(tiny_v32(layer_types=["full_attention"] * 3))
    cfg = adapter.config_from_hf(tiny_v32())
    with pytest.raises(ConfigError, match="source checkpoint"):
        adapter.config_to_hf(cfg, {})


def test_a_built_model_with_mtp_exports_and_comes_back(tmp_path):
    """A model built here (no HF source) with an MTP part: written as DeepseekV3 with
    num_nextn_predict_layers, the layer's embedding and head copies, and read back the same."""
    import json

    import composer
    from composer.convert import from_hf, to_hf
    from composer.zoo import get_preset
    from tests.helpers import read_all

    cfg = get_preset("deepseek-v3-debug").config()
    cfg.pattern += "/+E"
    model = composer.build_model(cfg, seed=3)
    composer.save(model, tmp_path / "built", family="deepseek-v3")
    to_hf(tmp_path / "built", tmp_path / "hf")
    hf = read_all(tmp_path / "hf")
    n = cfg.parsed.n_layers // 2
    assert json.loads((tmp_path / "hf" / "config.json").read_text())[
        "num_nextn_predict_layers"] == 1
    assert torch.equal(hf[f"model.layers.{n}.embed_tokens.weight"], hf["model.embed_tokens.weight"])
    assert torch.equal(hf[f"model.layers.{n}.shared_head.head.weight"], hf["lm_head.weight"])
    back = from_hf(tmp_path / "hf", tmp_path / "ours")
    # the preset's training-only MoE settings (bias update rate, sequence-wise loss) have no HF
    # field: the import gives the defaults, and everything else comes back
    assert back.moe.bias_update_rate == back.moe.seq_aux_loss_coeff == 0.0
    for name in MOE_TRAINING_ONLY:
        setattr(back.moe, name, getattr(cfg.moe, name))
    assert back.canonical() == cfg.canonical()
    ours, built = read_all(tmp_path / "ours"), read_all(tmp_path / "built")
    assert ours.keys() == built.keys()
    assert all(torch.equal(ours[k], built[k]) for k in built)
