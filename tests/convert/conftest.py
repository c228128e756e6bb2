"""Shared checks for converter tests: HF model (random weights) -> composer -> HF, proven on
logits and bytes. Every family's test calls ``check_family``."""

from __future__ import annotations

import json

import pytest
import torch

import composer
from composer.convert import from_hf, to_hf
from tests.helpers import FP32_PARITY, assert_same_tensors, load_hf, randomize, rel_err


@pytest.fixture
def check_family(tmp_path):
    """``check_family(hf_model, ids)``: the acceptance checks of the converters issue for one
    tiny random HF model (fp32): logits parity within ``FP32_PARITY`` relative (its docstring
    states the error model), bit-for-bit export, the same logits from transformers' reload of
    the export as from its reload of the source, and the same from a bf16 copy. Returns the
    composer config."""
    def run(hf_model: torch.nn.Module, ids: torch.Tensor | None = None, tol: float = FP32_PARITY,
            bf16: bool = True) -> composer.ModelConfig:
        hf_model.eval()
        src = tmp_path / "hf"
        hf_model.save_pretrained(src)
        cfg = from_hf(src, tmp_path / "ours")
        ours = composer.load(tmp_path / "ours")
        if ids is None:
            ids = torch.randint(0, cfg.vocab_size, (2, 19), generator=torch.Generator()
                                .manual_seed(1))
        with torch.no_grad():
            expected = hf_model(ids).logits
            got = ours(ids)
        assert rel_err(got, expected) < tol, rel_err(got, expected)
        to_hf(tmp_path / "ours", tmp_path / "back")
        assert_same_tensors(src, tmp_path / "back")
        # A reload against a reload, each in fresh memory (load_hf: a memory-mapped weight's
        # address, so the BLAS kernel that runs, depends on the file's layout, which ours and
        # transformers' writers choose differently): equal weights give equal bits.
        with torch.no_grad():
            assert torch.equal(load_hf(tmp_path / "back")(ids).logits, load_hf(src)(ids).logits)
        if bf16:
            src16 = tmp_path / "hf16"
            hf_model.to(torch.bfloat16).save_pretrained(src16)
            hf_model.float()
            from_hf(src16, tmp_path / "ours16")
            to_hf(tmp_path / "ours16", tmp_path / "back16")
            assert_same_tensors(src16, tmp_path / "back16")
            assert json.loads((tmp_path / "back16" / "config.json").read_text())["dtype"] \
                == "bfloat16"
        return cfg

    return run


@pytest.fixture(name="randomize")
def randomize_fixture():
    return randomize
