"""Zamba2 (Zamba2ForCausalLM): HF -> composer -> HF on tiny random configs (fp32): logits within
FP32_PARITY of transformers, bit-exact export in fp32 and bf16, transformers' reload of the export
gives the logits of its reload of the source, greedy generation equals transformers.generate;
each shared block is stored once (``shared.{a}.*``) and its per-site adapters map to our layers;
a composer-built model exports without a source; the refusals. Preset parameter counts against
transformers' class on meta: tests/zoo/test_presets.py (zamba2-1.2b, -2.7b, -7b, -debug)."""

from __future__ import annotations

import pytest
import torch

import composer
from composer.config import ConfigError
from composer.convert import from_hf, infer_adapter, to_hf
from composer.convert.zamba2 import Zamba2Adapter
from composer.zoo import get_preset
from tests.helpers import FP32_PARITY, hf_to_ours, rel_err

# 19 tokens over scan chunks of 8: the chunked scan's boundaries and a short last chunk.
IDS = torch.randint(0, 97, (2, 19), generator=torch.Generator().manual_seed(1))
TYPES = ["mamba", "hybrid", "mamba", "hybrid", "hybrid", "mamba", "hybrid"]
BASE = dict(vocab_size=97, hidden_size=16, num_hidden_layers=7, layers_block_type=TYPES,
            mamba_d_state=8, mamba_ngroups=2, n_mamba_heads=4, chunk_size=8,
            intermediate_size=24, num_attention_heads=2, num_mem_blocks=2, adapter_rank=4,
            use_shared_attention_adapter=True, use_mem_rope=True, max_position_embeddings=256)


def zamba2(**kw) -> torch.nn.Module:
    from transformers import Zamba2Config, Zamba2ForCausalLM

    return Zamba2ForCausalLM(Zamba2Config(**{**BASE, **kw})).eval()


CASES = {
    # two blocks ABAB with q/k/v adapters and RoPE (Zamba2-1.2B's options, 7B's two blocks)
    "abab": (dict(), "M{a:Z}M{b:Z}{a}M{b}"),
    # one block, no attention adapters, no RoPE, GQA, biases (2.7B's options and more)
    "one-block": (dict(num_mem_blocks=1, use_shared_attention_adapter=False, use_mem_rope=False,
                       num_key_value_heads=1, add_bias_linear=True,
                       layers_block_type=["mamba", "hybrid", "mamba", "hybrid"],
                       num_hidden_layers=4), "M{a:Z}M{a}"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_zamba2(check_family, randomize, name: str) -> None:
    kw, pattern = CASES[name]
    model = zamba2(**kw)
    randomize(model, seed=10)
    cfg = check_family(model, IDS)
    assert cfg.pattern == pattern and cfg.attention.d_head == 16
    assert cfg.attention.position == ("rope" if kw.get("use_mem_rope", True) else "none")
    assert cfg.mamba.dt_limit == (0.001, float("inf")) and cfg.mlp.activation == "geglu"


def test_shared_blocks_are_stored_once(tmp_path, randomize) -> None:
    """Our checkpoint holds each block once, under shared.a / shared.b, the adapters per layer."""
    from tests.helpers import read_all

    model = zamba2()
    randomize(model, seed=11)
    model.save_pretrained(tmp_path / "hf")
    from_hf(tmp_path / "hf", tmp_path / "ours")
    keys = set(read_all(tmp_path / "ours"))
    assert {k.split(".")[1] for k in keys if k.startswith("shared.")} == {"a", "b"}
    assert not any(".mixer.block." in k for k in keys)
    assert all(f"layers.{i}.mixer.adapters.q.down.weight" in keys for i in (1, 3, 4, 6))
    hf = read_all(tmp_path / "hf")
    torch.testing.assert_close(
        read_all(tmp_path / "ours")["layers.4.mixer.adapters.mlp.up.weight"],
        hf["model.layers.1.shared_transformer.feed_forward.gate_up_proj_adapter_list.2.1.weight"],
        rtol=0, atol=0)


def _hf_generate(hf: torch.nn.Module, ids: torch.Tensor, new: int) -> torch.Tensor:
    hf.generation_config.eos_token_id = None  # exactly `new` tokens on both sides
    with torch.no_grad():
        return hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                           do_sample=False, pad_token_id=0)


@pytest.mark.slow
def test_greedy_generation_equals_transformers(tmp_path, randomize) -> None:
    model = zamba2()
    randomize(model, seed=12)
    ours = hf_to_ours(model, tmp_path)
    for t in (5, 12):  # 12: the prefill's scan crosses a chunk
        ids = torch.randint(0, 97, (2, t), generator=torch.Generator().manual_seed(t))
        want = _hf_generate(model, ids, 16)
        got = composer.generate(ours, ids, 16)
        assert torch.equal(got, want), (t, got[:, t:], want[:, t:])


def test_composer_built_model_exports_without_a_source(tmp_path, randomize) -> None:
    from transformers import AutoModelForCausalLM

    cfg = get_preset("zamba2-debug").config()
    assert isinstance(infer_adapter(cfg), Zamba2Adapter)
    ours = composer.build_model(cfg)
    randomize(ours, seed=13)
    composer.save(ours, tmp_path / "ck")
    hf_cfg = to_hf(tmp_path / "ck", tmp_path / "hf")
    assert hf_cfg["architectures"] == ["Zamba2ForCausalLM"] and hf_cfg["num_mem_blocks"] == 2
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 19), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert rel_err(ours(ids), hf(ids).logits) < FP32_PARITY


def test_refusals() -> None:
    adapter = Zamba2Adapter()

    def refused(match: str, **changes) -> None:
        cfg = get_preset("zamba2-debug").config()
        for dotted, value in changes.items():
            section, _, field = dotted.partition("__")
            setattr(getattr(cfg, section) if field else cfg, field or section, value)
        with pytest.raises(ConfigError, match=match):
            adapter.config_to_hf(cfg, {})

    refused(r"every layer must be 'M' or a shared 'Z'", pattern="M*M")
    refused(r"layer 1 \('Z'\) is not a shared layer", pattern="MZM{a:Z}")
    refused("not used in turn", pattern="M{a:Z}M{b:Z}{b}M{a}")
    refused(r"norm_eps=1e-5", norm_eps=1e-6)
    refused(r"attention.softmax_scale=0.25", attention__softmax_scale=None)
    refused(r"mamba.dt_limit=\[dt_min, inf\]", mamba__dt_limit=(0.0, float("inf")))
    with pytest.raises(ConfigError, match="layers_block_type must list 2 entries"):
        adapter.config_from_hf({**BASE, "num_hidden_layers": 2, "layers_block_type": ["m", "g"]})
    refused(r"tie_embeddings=true \(transformers ties the shared blocks only then\)",
            tie_embeddings=False)
    with pytest.raises(ConfigError, match="transformers then ties nothing"):
        adapter.config_from_hf({**BASE, "tie_word_embeddings": False})
    with pytest.raises(ConfigError, match="gated norm always uses 1e-05"):
        adapter.config_from_hf({**BASE, "rms_norm_eps": 1e-6})
