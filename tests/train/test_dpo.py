"""The DPO objective in one process: the loss is the formula on fixed log-probs; at step 0
(policy = reference) it is ln 2 to fp64 precision, for a full copy and for LoRA; LoRA keeps no
reference copy while a full run keeps a frozen one that never moves; the gradient does not depend
on the micro-batch size (padding and accumulation); a tiny model learns a synthetic preference
(reward accuracy > 0.9); a resumed run rebuilds its reference and continues exactly; the
refusals."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from composer.config import ConfigError
from composer.data.chat_prepare import prepare_chat
from composer.data.chatset import TOKENIZER
from composer.train.dpo import dpo_loss
from tests.helpers import train_case
from tests.train.test_sft import assert_grads_close, step_grads

MOE = {"moe.n_experts": 4, "moe.top_k": 2, "moe.d_ff": 32, "moe.aux_loss_coeff": 0.0}
BASE = {"vocab_size": 259, "d_model": 32, "attention.n_heads": 4, "attention.n_kv_heads": 2,
        "mamba.n_heads": 4, "mamba.d_head": 8, "mamba.n_groups": 2, "mamba.d_state": 8,
        "mamba.chunk_size": 16, "mlp.d_ff": 64}
MODEL = {"pattern": "M*-E", "set": {**BASE, **MOE}}
DENSE = {"pattern": "M*-", "set": BASE}


def sort_rows(n: int, seed: int = 0) -> list[dict]:
    """Preference for a sorted answer: ``sort 3 1 4 1`` prefers ``1 1 3 4`` to ``4 3 1 1``
    (the same tokens, only their order tells them apart)."""
    rng = random.Random(seed)
    rows = []
    while len(rows) < n:
        d = [rng.randint(0, 9) for _ in range(rng.randint(2, 6))]
        up, down = sorted(d), sorted(d, reverse=True)
        if up != down:
            rows.append({"prompt": "sort " + " ".join(map(str, d)),
                         "chosen": " ".join(map(str, up)), "rejected": " ".join(map(str, down))})
    return rows


def preference_data(folder: Path, n: int = 240) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    src = folder / "sort.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in sort_rows(n)))
    prepare_chat([str(src)], str(folder / "sort"), str(TOKENIZER), kind="preference",
                 mask="completion")
    return str(folder / "sort")


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    return preference_data(tmp_path_factory.mktemp("dpo"))


def dpo_values(data: str, **kw) -> dict:
    return {"model": MODEL, "objective": "dpo", "data": [data], "steps": 2,
            "global_batch_size": 8, "lr": 3e-3, "dpo_beta": 0.1, "device": "cpu",
            "precision": "fp32", **kw}


def test_loss_is_the_formula_on_fixed_logprobs() -> None:
    logp_w = torch.tensor([-3.0, -10.0, -1.5, -200.0], dtype=torch.float64)
    logp_l = torch.tensor([-4.0, -2.0, -1.5, -100.0], dtype=torch.float64)
    ref_w = torch.tensor([-3.5, -9.0, -2.0, -250.0], dtype=torch.float64)
    ref_l = torch.tensor([-3.0, -3.0, -1.0, -90.0], dtype=torch.float64)
    for beta in (0.1, 0.5, 2.0):
        loss, chosen, rejected = dpo_loss(logp_w, logp_l, ref_w, ref_l, beta)
        for i in range(4):
            z = beta * ((logp_w[i] - ref_w[i]) - (logp_l[i] - ref_l[i])).item()
            expected = math.log1p(math.exp(-z)) if z > -30 else -z + math.log1p(math.exp(z))
            assert loss[i].item() == pytest.approx(expected, rel=1e-14, abs=1e-14)
            assert chosen[i].item() == pytest.approx(beta * (logp_w[i] - ref_w[i]).item())
            assert rejected[i].item() == pytest.approx(beta * (logp_l[i] - ref_l[i]).item())
    # the last pair: beta=2, z = 2 * (50 - (-10)) = 120: no overflow, loss ~ exp(-120)
    assert 0 < loss[3].item() < 1e-50
    zero = torch.zeros(3, dtype=torch.float64)
    assert dpo_loss(zero, zero, zero, zero, 0.1)[0].tolist() == [math.log(2)] * 3


def _counting_builds(monkeypatch) -> list[int]:
    import composer.run

    calls, build = [], composer.run.build_sharded

    def counted(*args, **kwargs):
        calls.append(1)
        return build(*args, **kwargs)

    monkeypatch.setattr(composer.run, "build_sharded", counted)
    return calls


def _run(values: dict):
    from composer.train.engine import resolve, setup

    recipe, resume = resolve(None, None, values)
    return setup(recipe, resume, quiet=True)


def _step0_and_train(run, last: int) -> dict:
    from composer.train.loop import train_loop

    try:
        return {"summary": train_loop(run, last, quiet=True)}
    finally:
        run.log.close()


def test_full_copy_step0_is_ln2_and_the_reference_stays(data, monkeypatch) -> None:
    calls = _counting_builds(monkeypatch)
    run, last = _run(dpo_values(data, split="80,20,0", eval_every=2, eval_iters=1))
    ref = run.ref_model
    assert ref.copies and ref.model is not run.model and len(calls) == 2
    assert not any(p.requires_grad for p in ref.model.parameters()) and not ref.model.training
    start = {k: v.clone() for k, v in ref.model.state_dict().items()}
    assert all(torch.equal(v, run.model.state_dict()[k]) for k, v in start.items())
    summary = _step0_and_train(run, last)["summary"]
    rows = summary.rows
    assert rows[0]["step"] == 0 and abs(rows[0]["val_loss"] - math.log(2)) <= 1e-12
    assert abs(summary.losses[0] - math.log(2)) <= 1e-12  # step 1 scores the start
    assert rows[1]["chosen_reward"] == rows[1]["rejected_reward"] == 0.0
    assert rows[1]["reward_accuracy"] == 0.0 and rows[1]["pairs"] == 8
    assert summary.losses[1] < math.log(2)  # one update later the pairs are preferred
    assert all(torch.equal(v, ref.model.state_dict()[k]) for k, v in start.items())
    assert any(not torch.equal(v, run.model.state_dict()[k]) for k, v in start.items())


def test_lora_keeps_no_copy_and_step0_is_ln2(data, monkeypatch) -> None:
    calls = _counting_builds(monkeypatch)
    run, last = _run(dpo_values(data, lora_rank=4, steps=3))
    ref = run.ref_model
    assert not ref.copies and ref.model is run.model and len(calls) == 1
    n_params = sum(p.numel() for p in run.model.parameters())
    assert sum(p.numel() for p in ref.model.parameters()) == n_params  # the same tensors
    mb = run.batches.local(0, 1, 0, 8)[0]
    ids = torch.from_numpy(mb.ids)
    from composer.blocks.model import completion_targets

    targets = completion_targets(ids, torch.from_numpy(mb.mask))
    before = ref.token_logprobs(ids, targets)
    summary = _step0_and_train(run, last)["summary"]
    assert abs(summary.losses[0] - math.log(2)) <= 1e-12
    assert summary.losses[-1] < math.log(2)
    assert torch.equal(ref.token_logprobs(ids, targets), before)  # the base did not move
    with torch.no_grad():
        policy = run.model.token_logprobs(ids, targets).logp
    assert not torch.equal(policy, before)  # the adapters did


def test_micro_batch_does_not_change_the_gradient(data) -> None:
    ref = step_grads(dpo_values(data, micro_batch_size=8))
    got = step_grads(dpo_values(data, micro_batch_size=2))
    assert_grads_close(got, ref)


STEPS = 20


def test_learns_a_synthetic_preference(tmp_path) -> None:
    """Reward accuracy on the training batches, and on held-out pairs, above 0.9."""
    data = preference_data(tmp_path, 400)
    out = train_case(dpo_values(data, model=DENSE, steps=STEPS, global_batch_size=16,
                                split="90,10,0", eval_every=STEPS, eval_iters=2,
                                warmup_steps=2))
    accuracy = [r["reward_accuracy"] for r in out["rows"] if "reward_accuracy" in r]
    first = next(i + 1 for i, a in enumerate(accuracy) if a > 0.9)  # measured: step 3
    assert first <= STEPS and np.mean(accuracy[-10:]) > 0.9, accuracy
    assert out["rows"][-1]["val_reward_accuracy"] > 0.9


def test_resume_rebuilds_the_reference_and_is_exact(data, tmp_path) -> None:
    straight = train_case(dpo_values(data, steps=4, save=str(tmp_path / "a")))
    train_case(dpo_values(data, steps=4, exit_at_step=2, save=str(tmp_path / "b")))
    rest = train_case({}, source=str(tmp_path / "b"))
    assert rest["losses"] == straight["losses"][2:]
    assert rest["rows"][-1]["tokens"] == straight["rows"][-1]["tokens"]
    for k, p in straight["params"].items():
        assert torch.equal(rest["params"][k], p), k


def test_refusals(data, tmp_path) -> None:
    from composer.train.engine import resolve, setup

    cases = [({"pp": 2}, "--objective dpo under --pp > 1 is not built yet"),
             ({"cp": 2}, "--objective dpo under --cp > 1 is not built yet"),
             ({"model": {**MODEL, "pattern": "M*-E/*E"}}, "with multi-token prediction"),
             ({"dpo_beta": 0.0}, "--dpo-beta must be > 0"),
             ({"tokens": "synthetic", "data": None}, "--objective dpo needs --data PREFIX")]
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n")
    prepare_chat([str(chat)], str(tmp_path / "chat"), str(TOKENIZER))
    cases.append(({"data": [str(tmp_path / "chat")]}, "is not a dataset of preference pairs"))
    for extra, message in cases:
        recipe, resume = resolve(None, None, {**dpo_values(data), **extra})
        with pytest.raises(ConfigError, match=message.replace("+", r"\+")):
            setup(recipe, resume, quiet=True)


def test_rows_are_padded_pairs(data) -> None:
    from composer.data.masked import MaskedDataset
    from composer.train.dpo import open_dpo_data
    from composer.train.recipe import Recipe

    train, _, longest = open_dpo_data(Recipe(objective="dpo", data=[data], seed=5,
                                             global_batch_size=4), _cfg())
    ds = MaskedDataset(data)
    order = np.random.default_rng([5, 0]).permutation(ds.n_documents // 2)
    assert longest == int(ds.lengths.max())
    (mb,) = train.local(4, 2, 1, 2)  # pairs 6 and 7 of the order
    assert mb.ids.shape[0] == 4
    for row, (i, side) in enumerate([(6, 0), (7, 0), (6, 1), (7, 1)]):
        ids, mask = ds.document(2 * int(order[i]) + side)
        assert mb.ids[row, :len(ids)].tolist() == ids.tolist()
        assert mb.mask[row, :len(ids)].tolist() == mask.tolist()
        assert not mb.mask[row, len(ids):].any()
    assert mb.tokens == sum(int(ds.lengths[2 * int(order[i]) + s]) for i in (6, 7)
                            for s in (0, 1))


def _cfg():
    from composer.train.engine import _model_config
    from composer.train.recipe import Recipe

    return _model_config(Recipe(model=MODEL))[0]


@pytest.mark.slow
def test_a_run_from_an_adapter_copies_the_adapted_start(data, tmp_path) -> None:
    """``--adapter DIR``: the start is base + that adapter, so the reference is a copy holding
    both (the base alone, adapters off, would not give ln 2 at step 0)."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("peft")
    from composer.cli import main
    from composer.convert import from_hf
    from composer.lora import disabled

    hf = tmp_path / "hf"
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=259, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2)).save_pretrained(hf)
    from_hf(hf, tmp_path / "ours")
    values = {k: v for k, v in dpo_values(data, lora_rank=4, lr=3e-2).items() if k != "model"}
    values["model"] = str(tmp_path / "ours")
    train_case({**values, "save": str(tmp_path / "lora")})
    assert main(["export", str(tmp_path / "lora"), str(tmp_path / "adapter"), "--adapter"]) == 0
    run, last = _run({**values, "lora_rank": 0, "adapter": str(tmp_path / "adapter")})
    ref = run.ref_model
    assert ref.copies and ref.model is not run.model
    mb = run.batches.local(0, 1, 0, 8)[0]
    ids = torch.from_numpy(mb.ids)
    from composer.blocks.model import completion_targets

    targets = completion_targets(ids, torch.from_numpy(mb.mask))
    with torch.no_grad(), disabled(run.model):
        base = run.model.token_logprobs(ids, targets).logp
    assert not torch.allclose(base, ref.token_logprobs(ids, targets))  # the adapter matters
    summary = _step0_and_train(run, last)["summary"]
    assert abs(summary.losses[0] - math.log(2)) <= 1e-12


def test_sft_refuses_a_preference_set(data) -> None:
    """Both sides of each pair would be trained as targets: refused with the objective to use."""
    from composer.train.engine import resolve, setup

    recipe, resume = resolve(None, None, {**dpo_values(data), "objective": "sft", "seq_len": 64})
    with pytest.raises(ConfigError, match="is a preference set .* --objective dpo"):
        setup(recipe, resume, quiet=True)
