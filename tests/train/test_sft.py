"""The SFT objective in one process: packed conversations compute what each computes alone
(logits fp32 1e-5, the masked loss as the token-weighted mean of the unpacked ones) for
``M*-E``, ``G*`` and ``+E``; the gradient of one step is the same for micro-batch 8 and 2 x
accumulation 4; ``composer train --objective sft`` end to end; its refusals."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from composer.build.builder import build_model
from composer.config import ConfigError, ModelConfig, apply_overrides
from composer.data.masked import MaskedDataset
from composer.data.sft import SFTSamples
from tests.data.test_sft_samples import write_masked
from tests.helpers import randomize

MOE = ["moe.n_experts=4", "moe.top_k=2", "moe.d_ff=32", "moe.aux_loss_coeff=0.0"]
PATTERNS = {
    "M*-E": ["d_model=32", "attention.n_heads=4", "attention.n_kv_heads=2", "mamba.n_heads=4",
             "mamba.d_head=8", "mamba.n_groups=2", "mamba.d_state=8", "mamba.chunk_size=8",
             "mlp.d_ff=64", *MOE],
    "G*": ["d_model=32", "attention.n_heads=4", "attention.n_kv_heads=2"],
    "+E": ["d_model=32", *MOE],
}
MODEL = {"pattern": "M*-E", "set": dict(s.split("=") for s in PATTERNS["M*-E"])}
LENGTHS = [5, 23, 9, 14, 1, 30, 7, 12, 16, 3, 11, 19, 8, 26, 2, 6, 13, 17, 4, 10, 21, 15, 9, 7]


def tiny(pattern: str) -> ModelConfig:
    cfg = ModelConfig(pattern=pattern)
    apply_overrides(cfg, ["vocab_size=61", *PATTERNS[pattern]])
    return cfg.validate()


def masked_data(tmp_path: Path, lengths: list[int] = LENGTHS, unsupervised: int = 0) -> str:
    """A masked dataset of ``lengths``, then ``unsupervised`` conversations of 32 tokens with
    no supervised token (each a whole row of 32: a micro-batch of one has no target)."""
    prefix = tmp_path / "chat"
    write_masked(prefix, lengths, vocab=61, seed=1)
    if unsupervised:
        from composer.data.masked import MaskedWriter

        ds = MaskedDataset(prefix)
        docs = [ds.document(d) for d in range(ds.n_documents)]
        rng = np.random.default_rng(2)
        (tmp_path / "all").mkdir()
        with MaskedWriter(tmp_path / "all" / "chat", np.uint16) as w:
            for ids, mask in docs:
                w.add_document(ids, mask)
            for _ in range(unsupervised):
                w.add_document(rng.integers(1, 61, 32), np.zeros(32, np.uint8))
        return str(tmp_path / "all" / "chat")
    return str(prefix)


@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_packed_equals_each_conversation_alone(tmp_path: Path, pattern: str) -> None:
    torch.manual_seed(0)
    model = build_model(tiny(pattern), seed=0)
    randomize(model, seed=1)
    model.eval()
    ds = MaskedDataset(masked_data(tmp_path))
    samples = SFTSamples(ds, 32, seed=0)
    rows = [samples.row(r) for r in range(samples.n_rows)]
    ids = torch.from_numpy(np.stack([r[0] for r in rows]))
    docs = torch.from_numpy(np.stack([r[1] for r in rows]))
    mask = torch.from_numpy(np.stack([r[2] for r in rows]))
    labels = ids.masked_fill(mask == 0, -100)
    with torch.no_grad():
        out = model(ids, labels, doc_ids=docs, return_logits=True)
        total, count = 0.0, 0
        for r in range(samples.n_rows):
            members = samples.row_docs[samples.row_start[r]:samples.row_start[r + 1]]
            pos = 0
            for d in members.tolist():
                doc_ids, doc_mask = (torch.from_numpy(x.astype(np.int64))[None]
                                     for x in ds.document(d))
                n = doc_ids.shape[1]
                alone = model(doc_ids)
                torch.testing.assert_close(out.logits[r:r + 1, pos:pos + n], alone, atol=1e-5,
                                           rtol=1e-5)
                targets = int(doc_mask[0, 1:].sum())
                if targets:
                    loss = model(doc_ids, doc_ids.masked_fill(doc_mask == 0, -100)).loss
                    total, count = total + float(loss) * targets, count + targets
                pos += n
    assert count == int(((labels[:, 1:] != -100) & (docs[:, 1:] == docs[:, :-1])).sum())
    assert float(out.loss) == pytest.approx(total / count, rel=1e-5)


def sft_values(data: str, **kw) -> dict:
    return {"model": MODEL, "objective": "sft", "data": [data], "seq_len": 32, "steps": 2,
            "global_batch_size": 8, "lr": 1e-3, "device": "cpu", "precision": "fp32", **kw}


def step_grads(values: dict) -> dict[str, torch.Tensor]:
    """The gradient of the run's first step (every rank calls it; whole tensors)."""
    from composer.parallel.data import finish_grads
    from composer.train.engine import resolve, setup
    from composer.train.loop import accumulate

    recipe, resume = resolve(None, None, values)
    run, _ = setup(recipe, resume, quiet=True)
    try:
        accumulate(run)
        finish_grads(run.model, run.dims)
    finally:
        run.log.close()

    def whole(g: torch.Tensor) -> torch.Tensor:
        return (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()

    return {k: whole(p.grad) for k, p in run.model.named_parameters() if p.grad is not None}


def assert_grads_close(a: dict, b: dict, tol: float = 1e-6) -> None:
    """Every gradient equal to ``tol`` relative to the larger of its own largest entry and the
    model's: a split of the batch changes the fp32 summation order, whose rounding scales with
    the summands (bounded by the model's largest gradients), not with a sum that cancels to a
    small value (``A_log``'s); a wrong normalisation is off by a factor, far above either."""
    assert a.keys() == b.keys()
    model = max(float(g.double().abs().max()) for g in b.values())
    for k in a:
        err = float((a[k].double() - b[k].double()).abs().max())
        scale = max(float(b[k].double().abs().max()), model, 1e-12)
        assert err <= tol * scale, (k, err, scale)


@pytest.mark.slow
def test_micro_batch_does_not_change_the_gradient(tmp_path: Path) -> None:
    data = masked_data(tmp_path, LENGTHS * 3)
    ref = step_grads(sft_values(data, micro_batch_size=8))
    got = step_grads(sft_values(data, micro_batch_size=2))
    assert_grads_close(got, ref)


DENSE = {"pattern": "G*", "set": dict(s.split("=") for s in PATTERNS["G*"])}


@pytest.mark.slow
@pytest.mark.parametrize("model", [MODEL, DENSE], ids=["moe", "dense"])
def test_a_micro_batch_without_targets_adds_nothing(tmp_path: Path, model: dict) -> None:
    from composer.train.engine import resolve, setup

    data = masked_data(tmp_path, LENGTHS, unsupervised=6)
    recipe, _ = resolve(None, None, sft_values(data, micro_batch_size=1, model=model))
    run, _ = setup(recipe, None, quiet=True)
    run.log.close()
    micro = run.batches.local(0, 1, 0, 1)
    assert any((mb.labels[:, 1:] == -100).all() for mb in micro)  # the case is exercised
    ref = step_grads(sft_values(data, micro_batch_size=8, model=model))
    got = step_grads(sft_values(data, micro_batch_size=1, model=model))
    assert all(torch.isfinite(g).all() for g in got.values())
    assert_grads_close(got, ref)


@pytest.mark.slow
def test_sft_end_to_end(tmp_path: Path, capsys) -> None:
    from composer.cli import main

    data = masked_data(tmp_path, LENGTHS * 2 + [40, 45])
    cfg = tmp_path / "r.yaml"
    cfg.write_text(json.dumps({"model": MODEL}))
    code = main(["train", "--config", str(cfg), "--objective", "sft", "--data", data,
                 "--seq-len", "32", "--steps", "3", "--global-batch-size", "4", "--lr", "3e-3",
                 "--device", "cpu", "--precision", "fp32", "--split", "80,20,0",
                 "--eval-every", "3", "--save", str(tmp_path / "run")])
    assert code in (0, None)
    err = capsys.readouterr().err
    assert "2 conversation(s) longer than --seq-len 32 truncated (--truncate right)" in err
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["supervised_tokens"] > 0 and np.isfinite(r["loss"]) for r in rows)
    assert rows[-1]["tokens"] == sum(r["supervised_tokens"] for r in rows)
    assert np.isfinite(rows[-1]["val_loss"])


def test_sft_refuses_data_without_a_mask(tmp_path: Path) -> None:
    from composer.train.engine import resolve, setup

    recipe, resume = resolve(None, None, {**sft_values(""), "tokens": "synthetic",
                                          "data": None})
    with pytest.raises(ConfigError, match="--objective sft needs --data PREFIX"):
        setup(recipe, resume, quiet=True)
    from composer.data.indexed import IndexedWriter

    with IndexedWriter(tmp_path / "plain", np.uint16) as w:
        w.add_document(np.arange(40))
    recipe, resume = resolve(None, None, sft_values(str(tmp_path / "plain")))
    with pytest.raises(ConfigError, match="has no loss mask"):
        setup(recipe, resume, quiet=True)


@pytest.mark.slow
def test_sft_from_a_hugging_face_folder(tmp_path: Path) -> None:
    """SOURCE a Hugging Face folder: converted, trained from (the initial weights are the
    conversion's), and its tokenizer kept in SAVE/tokenizer (the data carries none)."""
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    import composer
    from composer.convert import from_hf
    from composer.train.engine import resolve, setup
    from composer.train.loop import train_loop

    hf = tmp_path / "hf"
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    model.save_pretrained(hf)
    vocab = {f"t{i}": i for i in range(97)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(hf / "tokenizer.json"))
    data = masked_data(tmp_path)
    values = {k: v for k, v in sft_values(data, steps=1, save=str(tmp_path / "run")).items()
              if k != "model"}
    recipe, resume = resolve(str(hf), None, values)
    run, last = setup(recipe, resume, quiet=True)
    from_hf(hf, tmp_path / "ours")
    ref = composer.load(tmp_path / "ours").state_dict()
    for k, v in run.model.state_dict().items():
        assert torch.equal(v, ref[k].to(v.dtype)), k
    try:
        summary = train_loop(run, last, quiet=True)
    finally:
        run.log.close()
    assert np.isfinite(summary.loss)
    assert (tmp_path / "run" / "tokenizer" / "tokenizer.json").is_file()


def test_a_blend_of_masked_datasets_gives_masked_labels(tmp_path: Path) -> None:
    from composer.train.objectives import open_sft_data, stand_in_labels
    from composer.train.recipe import Recipe

    a = write_masked(tmp_path / "a", LENGTHS, vocab=61, seed=1)
    b = write_masked(tmp_path / "b", LENGTHS[::-1], vocab=61, seed=2)
    recipe = Recipe(objective="sft", data=["0.5", str(a), "0.5", str(b)], seq_len=32,
                    global_batch_size=4, split="80,20,0")
    train, valid, seq_len = open_sft_data(recipe, tiny("M*-E"))
    assert seq_len == 32 and valid is not None
    for mb in train.local(0, 1, 0, 2) + valid.local(0, 1, 0, 4):
        assert mb.ids.shape == mb.labels.shape == mb.doc_ids.shape
        supervised = mb.labels != -100
        assert (mb.labels[supervised] == mb.ids[supervised]).all() and supervised.any()
    mb = train.local(0, 1, 0, 1)[0]
    mb.labels[:] = -100
    stand_in = stand_in_labels(mb, True)
    assert (stand_in.labels != -100).sum() == 1


@pytest.mark.slow
def test_sft_resume_is_exact(tmp_path: Path) -> None:
    from tests.helpers import train_case

    data = masked_data(tmp_path, LENGTHS * 2)
    straight = train_case(sft_values(data, steps=4, save=str(tmp_path / "a")))
    train_case(sft_values(data, steps=4, exit_at_step=2, save=str(tmp_path / "b")))
    rest = train_case({}, source=str(tmp_path / "b"))
    assert rest["losses"] == straight["losses"][2:]
    assert rest["rows"][-1]["tokens"] == straight["rows"][-1]["tokens"]
    for k, p in straight["params"].items():
        assert torch.equal(rest["params"][k], p), k


def test_sft_refuses_mtp_under_pp_or_cp(tmp_path: Path) -> None:
    from composer.train.engine import resolve, setup

    data = masked_data(tmp_path)
    for layout in ({"cp": 2}, {"pp": 2}):
        recipe, resume = resolve(None, None, sft_values(
            data, model={**MODEL, "pattern": "M*-E/*E"}, **layout))
        with pytest.raises(ConfigError, match="multi-token prediction under --pp or --cp"):
            setup(recipe, resume, quiet=True)
