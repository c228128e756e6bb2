"""Every zoo preset's -debug flavour, built with `composer build --out`, exports to HF as its own
family's class (the preset's family is recorded in origin.json; Qwen3.5 configs are also Qwen3-Next
configs) and loads there with the same logits."""

import json

import pytest
import torch

import composer
from composer.cli import main
from composer.zoo import presets

DEBUG = sorted(name for name in presets() if name.endswith("-debug"))
ARCH = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM",
        "qwen3-moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM",
        "mamba2": "Mamba2ForCausalLM", "nemotron-h": "NemotronHForCausalLM",
        "glm4-moe": "Glm4MoeForCausalLM", "minimax-m2": "MiniMaxM2ForCausalLM",
        "deepseek-v3": "DeepseekV3ForCausalLM", "olmo-hybrid": "OlmoHybridForCausalLM",
        "qwen3-next": "Qwen3NextForCausalLM", "qwen3.5": "Qwen3_5ForCausalLM",
        "qwen3.5-moe": "Qwen3_5MoeForCausalLM"}


@pytest.mark.parametrize("name", DEBUG)
def test_debug_preset_exports_and_loads(tmp_path, capsys, name):
    from transformers import AutoModelForCausalLM

    assert main(["build", "--preset", name, "--seed", "5", "--out", str(tmp_path / "ck")]) == 0
    assert main(["convert", "to-hf", str(tmp_path / "ck"), str(tmp_path / "hf"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert info["architecture"] == ARCH[presets()[name].family]
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ours = composer.load(tmp_path / "ck")
    ids = torch.randint(0, ours.config.vocab_size, (2, 21), generator=torch.Generator()
                        .manual_seed(0))
    with torch.no_grad():
        expected, got = hf(ids).logits, ours(ids)
    err = ((got - expected).abs().max() / expected.abs().max()).item()
    assert err < 1e-4, err
