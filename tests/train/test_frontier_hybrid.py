"""A hybrid of every built kind, `G+M*-E` (gated delta net, multi-latent attention, Mamba-2,
attention, MLP, MoE), builds, trains with the engine (loss falls over 30 steps) and round-trips
through `composer export`: the portable checkpoint holds the trained weights bit for bit."""

import pytest
import torch

from composer.cli import main
from tests.helpers import read_all, train_case

MODEL = {"pattern": "G+M*-E", "set": {
    "d_model": 32, "vocab_size": 61,
    "gdn.n_heads": 4, "gdn.n_kv_heads": 2, "gdn.d_head_k": 8, "gdn.d_head_v": 8,
    "gdn.chunk_size": 8,
    "mla.n_heads": 4, "mla.q_lora_rank": 16, "mla.kv_lora_rank": 16, "mla.d_head_nope": 8,
    "mla.d_head_rope": 4, "mla.d_head_v": 8,
    "attention.n_heads": 4, "attention.n_kv_heads": 2,
    "mamba.n_heads": 4, "mamba.d_head": 8, "mamba.n_groups": 2, "mamba.d_state": 8,
    "mamba.chunk_size": 8, "mlp.d_ff": 64, "moe.n_experts": 4, "moe.top_k": 2, "moe.d_ff": 32}}


@pytest.mark.slow
def test_every_kind_trains_and_exports(tmp_path):
    run = tmp_path / "run"
    out = train_case({"model": MODEL, "tokens": "synthetic", "seq_len": 16, "steps": 30,
                      "global_batch_size": 8, "lr": 3e-3, "device": "cpu",
                      "precision": "fp32", "save": str(run)})
    assert out["losses"][-1] < out["losses"][0] - 0.5, out["losses"][::10]
    assert main(["export", str(run), str(tmp_path / "portable")]) == 0
    exported = read_all(tmp_path / "portable")
    from composer.build.builder import load

    model = load(tmp_path / "portable")
    for name, p in model.named_parameters():
        assert torch.equal(p, out["params"][name]), name
    assert any(k.startswith("layers.0.mixer.") for k in exported)  # the G layer's tensors
