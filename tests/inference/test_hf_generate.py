"""Greedy generation equals transformers' ``generate(do_sample=False)`` on the same weights: every
zoo family's -debug flavour (built here, random weights, exported with ``to-hf``) and Bamba /
Granite-4.0-H (built in transformers, converted with ``from-hf``); prompts of two lengths, 32
new tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import composer
from composer.convert import from_hf, to_hf
from composer.zoo import presets
from tests.helpers import randomize

DEBUG = sorted(name for name in presets() if name.endswith("-debug"))
NEW = 32
LENGTHS = (5, 12)  # 12 > the Mamba debug chunk sizes: the prefill scan crosses chunks


def _hf_generate(hf: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    hf.generation_config.eos_token_id = None  # exactly NEW tokens on both sides
    with torch.no_grad():
        return hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                           do_sample=False, pad_token_id=0)


def _check_same(ours: composer.HybridModel, hf: torch.nn.Module, vocab: int) -> None:
    for t in LENGTHS:
        ids = torch.randint(0, vocab, (2, t), generator=torch.Generator().manual_seed(t))
        want = _hf_generate(hf, ids)
        got = composer.generate(ours, ids, NEW)
        assert want.shape == got.shape == (2, t + NEW)
        assert torch.equal(got, want), (t, got[:, t:], want[:, t:])


SLOW = {"deepseek-v3-debug", "glm4-moe-debug", "olmo-hybrid-debug"}  # 2 s or more each


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n
                                  for n in DEBUG])
def test_greedy_equals_transformers(tmp_path: Path, name: str) -> None:
    from transformers import AutoModelForCausalLM

    preset = presets()[name]
    model = composer.build_model(preset.config(), seed=0)
    randomize(model, seed=3)  # well-separated logits: no argmax decided by rounding
    composer.save(model, tmp_path / "ck", family=preset.family)
    to_hf(tmp_path / "ck", tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    _check_same(model, hf, model.config.vocab_size)


def _bamba_like(cls_name: str, **extra) -> torch.nn.Module:
    import transformers

    hf_cfg = getattr(transformers, f"{cls_name}Config")(
        vocab_size=97, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, mamba_n_heads=8, mamba_n_groups=2, mamba_d_state=8,
        mamba_chunk_size=8, mamba_expand=2, max_position_embeddings=256, **extra)
    return getattr(transformers, f"{cls_name}ForCausalLM")(hf_cfg)


@pytest.mark.parametrize("family", ["bamba", "granite-hybrid"])
def test_greedy_equals_transformers_granite(tmp_path: Path, family: str) -> None:
    if family == "bamba":
        hf = _bamba_like("Bamba", intermediate_size=48, attn_layer_indices=[1])
    else:
        hf = _bamba_like("GraniteMoeHybrid", intermediate_size=16, shared_intermediate_size=24,
                         num_local_experts=4, num_experts_per_tok=2,
                         layer_types=["mamba", "attention", "mamba"],
                         position_embedding_type="rope", embedding_multiplier=12.0,
                         residual_multiplier=0.22, attention_multiplier=0.015,
                         logits_scaling=8.0)
    randomize(hf, seed=4)
    hf.eval().save_pretrained(tmp_path / "hf")
    from_hf(tmp_path / "hf", tmp_path / "ours")
    _check_same(composer.load(tmp_path / "ours"), hf, 97)
