"""Jamba (JambaForCausalLM): HF -> composer -> HF on tiny random configs (fp32): logits within
FP32_PARITY of transformers, bit-exact export in fp32 and bf16, transformers' reload of the export
gives the logits of its reload of the source, greedy generation equals transformers.generate;
the in-memory fused expert layout is read and written back as it was; a composer-built model
exports without a source; the layer periods; the refusals. Preset parameter counts against
transformers' class on meta: tests/zoo/test_presets.py (jamba-1.5-mini, jamba-debug)."""

from __future__ import annotations

import pytest
import torch

import composer
from composer.config import ConfigError
from composer.convert import from_hf, infer_adapter, to_hf
from composer.convert.jamba import JambaAdapter, periods_of
from composer.kernels import selective_scan
from composer.zoo import get_preset
from tests.helpers import FP32_PARITY, hf_to_ours, rel_err

# 19 tokens over scan chunks of 8 (below): the chunked scan's boundaries and a short last chunk.
IDS = torch.randint(0, 97, (2, 19), generator=torch.Generator().manual_seed(1))
BASE = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, attn_layer_period=2,
            attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=0, num_experts=4,
            num_experts_per_tok=2, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
            mamba_dt_rank=4, max_position_embeddings=256)


@pytest.fixture(autouse=True)
def short_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(selective_scan, "TORCH_CHUNK", 8)


def jamba(**kw) -> torch.nn.Module:
    from transformers import JambaConfig, JambaForCausalLM

    return JambaForCausalLM(JambaConfig(**{**BASE, **kw})).eval()


CASES = {
    "moe": (dict(), "SE*-SE*-"),
    # tied, biases on in/out_proj, none on the conv, a head width of its own, every MLP dense
    "dense-tied": (dict(num_hidden_layers=3, attn_layer_period=3, attn_layer_offset=2,
                        num_experts=1, tie_word_embeddings=True, mamba_proj_bias=True,
                        mamba_conv_bias=False, head_dim=16), "S-S-*-"),
    "1.5-layout": (dict(num_hidden_layers=8, attn_layer_period=8, attn_layer_offset=4,
                        expert_layer_offset=1, mamba_dt_rank="auto"), "S-SES-SE*-SES-SE"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_jamba(check_family, randomize, name: str) -> None:
    kw, pattern = CASES[name]
    model = jamba(**kw)
    randomize(model, seed=10)
    cfg = check_family(model, IDS)
    assert cfg.pattern == pattern and cfg.attention.position == "none"
    assert cfg.mamba1.inner_norms == "learned" and cfg.mamba1.d_inner == 64
    assert cfg.tie_embeddings == kw.get("tie_word_embeddings", False)
    if cfg.moe is not None:
        assert (cfg.moe.score_func, cfg.moe.renormalize, cfg.moe.top_k) == ("softmax", False, 2)
    if name == "1.5-layout":
        assert cfg.mamba1.dt_rank == 2  # "auto": ceil(32 / 16)
    if name == "dense-tied":
        assert cfg.attention.d_head == 16 and cfg.moe is None and cfg.mamba1.proj_bias


def test_in_memory_fused_experts_are_read(tmp_path, randomize) -> None:
    """save_original_format=False writes experts.gate_up_proj [E, 2I, H] / down_proj: read them
    (logits), and export them in the layout the source had, byte for byte."""
    from tests.helpers import assert_same_tensors

    model = jamba()
    randomize(model, seed=11)
    model.save_pretrained(tmp_path / "mem", save_original_format=False)
    from_hf(tmp_path / "mem", tmp_path / "ours")
    with torch.no_grad():
        assert rel_err(composer.load(tmp_path / "ours")(IDS), model(IDS).logits) < FP32_PARITY
    to_hf(tmp_path / "ours", tmp_path / "back")
    assert_same_tensors(tmp_path / "mem", tmp_path / "back")


def _hf_generate(hf: torch.nn.Module, ids: torch.Tensor, new: int) -> torch.Tensor:
    hf.generation_config.eos_token_id = None  # exactly `new` tokens on both sides
    with torch.no_grad():
        return hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                           do_sample=False, pad_token_id=0)


def test_greedy_generation_equals_transformers(tmp_path, randomize) -> None:
    model = jamba()
    randomize(model, seed=12)
    ours = hf_to_ours(model, tmp_path)
    for t in (5, 12):  # 12: the prefill's scan crosses a chunk
        ids = torch.randint(0, 97, (2, t), generator=torch.Generator().manual_seed(t))
        want = _hf_generate(model, ids, 24)
        got = composer.generate(ours, ids, 24)
        assert torch.equal(got, want), (t, got[:, t:], want[:, t:])


def test_composer_built_model_exports_without_a_source(tmp_path, randomize) -> None:
    from transformers import AutoModelForCausalLM

    cfg = get_preset("jamba-debug").config()
    assert isinstance(infer_adapter(cfg), JambaAdapter)
    ours = composer.build_model(cfg)
    randomize(ours, seed=13)
    composer.save(ours, tmp_path / "ck")
    hf_cfg = to_hf(tmp_path / "ck", tmp_path / "hf")
    assert hf_cfg["architectures"] == ["JambaForCausalLM"]
    # no source periods: the smallest that give the pattern (4 layers: 3 fits as well as 4)
    assert (hf_cfg["attn_layer_period"], hf_cfg["attn_layer_offset"]) == (3, 2)
    assert (hf_cfg["expert_layer_period"], hf_cfg["expert_layer_offset"]) == (2, 1)
    assert "rope_parameters" not in hf_cfg and "head_dim" not in hf_cfg
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = torch.randint(0, 512, (2, 19), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert rel_err(ours(ids), hf(ids).logits) < FP32_PARITY


def test_layer_periods() -> None:
    """The source's periods when they still give the pattern, else the smallest; no layer of a
    kind is a period longer than the model."""
    flags = [i % 8 == 4 for i in range(16)]
    assert periods_of(flags, None) == (8, 4) and periods_of(flags, (8, 4)) == (8, 4)
    assert periods_of([False, True, False, True], (4, 1)) == (2, 1)
    assert periods_of([False, True, False, True], (2, 1)) == (2, 1)
    assert periods_of([True, True], None) == (1, 0)
    assert periods_of([False] * 3, None) == (4, 3)
    assert periods_of([True, True, False], None) is None
    cfg = JambaAdapter().config_from_hf({**BASE, "num_hidden_layers": 6, "attn_layer_period": 6,
                                         "attn_layer_offset": 3})
    out = JambaAdapter().config_to_hf(cfg, {"attn_layer_period": 6, "attn_layer_offset": 3})
    assert (out["attn_layer_period"], out["attn_layer_offset"]) == (6, 3)
    assert JambaAdapter().config_from_hf(out) == cfg


def test_refusals() -> None:
    adapter = JambaAdapter()

    def refused(match: str, **changes) -> None:
        cfg = get_preset("jamba-debug").config()
        for dotted, value in changes.items():
            section, _, field = dotted.partition("__")
            setattr(getattr(cfg, section) if field else cfg, field or section, value)
        with pytest.raises(ConfigError, match=match):
            adapter.config_to_hf(cfg, {})

    refused("moe.renormalize=false", moe__renormalize=True)
    refused("mamba1.inner_norms=learned", mamba1__inner_norms="weightless")
    refused(r"position 'none' \(Jamba has no RoPE\)", attention__position="rope")
    refused("share intermediate_size", mlp__d_ff=64)
    refused("not a multiple of d_model", mamba1__d_inner=96)
    refused("every layer must be 'S-', 'SE', '\\*-' or '\\*E'", pattern="S-M-")
    refused("its attention layers are not every attn_layer_period layers", pattern="*-*-S-*-")
    with pytest.raises(ConfigError, match=r"attn_layer_offset \(8\) must be in \[0, "
                                          r"attn_layer_period \(8\)\)"):
        adapter.config_from_hf({**BASE, "attn_layer_period": 8, "attn_layer_offset": 8})
    with pytest.raises(ConfigError, match="also the Mamba convolution's activation"):
        adapter.config_from_hf({**BASE, "hidden_act": "gelu"})
