"""Every zoo preset's -debug flavour, built with `composer build --out`, exports to HF as its own
family's class (the preset's family is recorded in origin.json; Qwen3.5 configs are also Qwen3-Next
configs) with a max_position_embeddings wherever the HF config has one, and loads there without a
warning about it, with the same logits."""

import json
import logging
import warnings

import pytest
import torch

import composer
from composer.cli import main
from composer.zoo import presets
from tests.helpers import FP32_PARITY, rel_err

DEBUG = sorted(name for name in presets() if name.endswith("-debug"))
ARCH = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM",
        "qwen3-moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM",
        "mamba2": "Mamba2ForCausalLM", "nemotron-h": "NemotronHForCausalLM",
        "glm4-moe": "Glm4MoeForCausalLM", "minimax-m2": "MiniMaxM2ForCausalLM",
        "deepseek-v3": "DeepseekV3ForCausalLM", "olmo-hybrid": "OlmoHybridForCausalLM",
        "qwen3-next": "Qwen3NextForCausalLM", "qwen3.5": "Qwen3_5ForCausalLM",
        "qwen3.5-moe": "Qwen3_5MoeForCausalLM", "qwen3.5-vl": "Qwen3_5ForConditionalGeneration",
        "qwen3.5-moe-vl": "Qwen3_5MoeForConditionalGeneration", "lfm2": "Lfm2ForCausalLM",
        "lfm2-moe": "Lfm2MoeForCausalLM", "jamba": "JambaForCausalLM",
        "gemma3": "Gemma3ForCausalLM",
        "kimi-linear": "KimiLinearForCausalLM",
        "gpt-oss": "GptOssForCausalLM",
        "falcon-h1": "FalconH1ForCausalLM",
        "zamba2": "Zamba2ForCausalLM"}


@pytest.mark.parametrize("name", DEBUG)
def test_debug_preset_exports_and_loads(tmp_path, capsys, name):
    from transformers import AutoModelForCausalLM

    assert main(["build", "--preset", name, "--seed", "5", "--out", str(tmp_path / "ck")]) == 0
    assert main(["convert", "to-hf", str(tmp_path / "ck"), str(tmp_path / "hf"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert info["architecture"] == ARCH[presets()[name].family]
    hf_cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    records = _Records()
    logger = logging.getLogger("transformers")
    logger.addHandler(records)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    finally:
        logger.removeHandler(records)
    said = records.messages + [str(w.message) for w in caught]
    assert not [m for m in said if "max_position_embeddings" in m], said
    has_field = hasattr(type(hf.config)(), "max_position_embeddings")
    assert ("max_position_embeddings" in hf_cfg) == has_field
    if has_field:
        assert hf_cfg["max_position_embeddings"] == hf.config.max_position_embeddings > 0
    ours = composer.load(tmp_path / "ck")
    ids = torch.randint(0, ours.config.vocab_size, (2, 21), generator=torch.Generator()
                        .manual_seed(0))
    with torch.no_grad():
        expected, got = hf(ids).logits, ours(ids)
    assert rel_err(got, expected) < FP32_PARITY, rel_err(got, expected)


class _Records(logging.Handler):
    """The messages transformers logs (its logger does not propagate to pytest's caplog)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_max_positions_follow_a_scaled_rope():
    """A scaled RoPE is written with the length it is scaled to (original * factor); without
    scaling, the HF config class's default."""
    from composer.convert.base import max_positions
    from composer.zoo import get_preset

    assert max_positions(get_preset("llama-debug").config(), 2048) == 8192 * 8
    assert max_positions(get_preset("deepseek-v3-671b").config(), 4096) == 163840
    assert max_positions(get_preset("qwen3-debug").config(), 32768) == 32768
