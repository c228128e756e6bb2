"""Shared checks for converter tests: HF model (random weights) -> composer -> HF, proven on
logits and bytes. Every family's test calls ``check_family``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import composer
from composer.convert import from_hf, to_hf


def randomize(model: torch.nn.Module, seed: int = 0, std: float = 0.2) -> None:
    """Random weights (not default init) so that a swapped or dropped tensor shows in logits;
    norm-like vectors are centred on 1, buffers (e.g. score-correction biases) get noise too."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if not p.is_floating_point() or "inv_freq" in name:
                continue
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32) * std
            centre = 1.0 if (p.ndim == 1 and ("norm" in name or name.endswith(".D"))) else 0.0
            p.copy_((noise + centre).to(p.dtype))


def read_all(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for k in f.keys():
                out[k] = f.get_tensor(k)
    return out


def assert_same_tensors(a: Path, b: Path) -> None:
    x, y = read_all(a), read_all(b)
    assert sorted(x) == sorted(y), (sorted(set(x) ^ set(y)))[:10]
    for k in x:
        assert x[k].dtype == y[k].dtype, (k, x[k].dtype, y[k].dtype)
        assert x[k].shape == y[k].shape, k
        assert torch.equal(x[k].view(torch.uint8) if x[k].dtype != torch.bool else x[k],
                           y[k].view(torch.uint8) if y[k].dtype != torch.bool else y[k]), k


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


@pytest.fixture
def check_family(tmp_path):
    """``check_family(hf_model, ids)``: the acceptance checks of the converters issue for one
    tiny random HF model (fp32): logits parity < 1e-4 relative, bit-for-bit export, identical
    logits after transformers reloads the export, and the same from a bf16 copy. Returns the
    composer config."""
    from transformers import AutoModelForCausalLM

    def run(hf_model: torch.nn.Module, ids: torch.Tensor | None = None, tol: float = 1e-4,
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
        reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
        with torch.no_grad():
            assert torch.equal(reloaded(ids).logits, expected)
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
