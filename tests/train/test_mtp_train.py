"""A model with multi-token prediction (``main/p``) trains under the engine in one process: the
loss falls, and the trained MTP depth predicts two tokens ahead better than at initialisation."""

import math

import torch

from composer import ModelConfig, apply_overrides, build_model
from composer.train.data import synthetic_rows
from tests.helpers import train_case

SET = {"d_model": 32, "vocab_size": 61, "attention.n_heads": 4, "attention.n_kv_heads": 2,
       "mamba.n_heads": 4, "mamba.d_head": 8, "mamba.n_groups": 2, "mamba.d_state": 8,
       "mamba.chunk_size": 8, "mlp.d_ff": 64, "moe.n_experts": 4, "moe.top_k": 2,
       "moe.d_ff": 32, "moe.aux_loss_coeff": 0.01, "mtp.loss_weight": 0.5}
PATTERN = "M*-/*E"


def test_a_model_with_mtp_trains():
    recipe = {"model": {"pattern": PATTERN, "set": SET}, "tokens": "synthetic", "seq_len": 16,
              "steps": 20, "global_batch_size": 8, "lr": 1e-2, "device": "cpu",
              "precision": "fp32"}
    out = train_case(recipe)
    assert all(math.isfinite(x) for x in out["losses"])
    # metrics.jsonl rows carry the weighted MTP term beside the main cross-entropy
    assert all(math.isfinite(r["mtp_loss"]) and r["mtp_loss"] > 0 for r in out["rows"])
    assert out["losses"][-1] < 0.8 * out["losses"][0]
    cfg = apply_overrides(ModelConfig(pattern=PATTERN), [f"{k}={v}" for k, v in SET.items()])
    start, trained = build_model(cfg, seed=0), build_model(cfg, seed=0)
    assert sorted(out["params"]) == sorted(k for k, _ in trained.named_parameters())
    trained.load_state_dict(out["params"], strict=False)  # parameters: every one (above)
    moved = (out["params"]["mtp.0.proj.weight"] - start.mtp[0].proj.weight).abs().max()
    assert moved > 1e-3  # the engine trains the MTP depth
    ids = torch.from_numpy(synthetic_rows(61, 16, seed=9, n_rows=8)).long()
    with torch.no_grad():
        before, after = start(ids, ids), trained(ids, ids)
    assert torch.isfinite(after.mtp_loss) and len(after.mtp_losses) == 1
    assert after.mtp_loss == 0.5 * after.mtp_losses[0]  # w / D with D = 1
    assert after.mtp_losses[0] < 0.8 * before.mtp_losses[0]
