"""The training engine in one process: schedules, accumulation, precision, activation
checkpointing, Muon, exact resume, non-finite steps, checkpoints kept, the debug recipe."""

import json
import math

import pytest
import torch

from composer.cli import main
from composer.train.schedule import Schedule
from tests.helpers import train_case

MODEL = {"pattern": "M*-E", "set": {
    "d_model": 32, "vocab_size": 61, "attention.n_heads": 4, "attention.n_kv_heads": 2,
    "mamba.n_heads": 4, "mamba.d_head": 8, "mamba.n_groups": 2, "mamba.d_state": 8,
    "mamba.chunk_size": 8, "mlp.d_ff": 64, "moe.n_experts": 4, "moe.top_k": 2, "moe.d_ff": 32,
    "moe.aux_loss_coeff": 0.0}}
BASE = {"model": MODEL, "tokens": "synthetic", "seq_len": 16, "steps": 4,
        "global_batch_size": 8, "lr": 3e-3, "device": "cpu", "precision": "fp32"}


def recipe(**kw) -> dict:
    return {**BASE, **kw}


def close(a: dict, b: dict, tol: float) -> None:
    for k in a:
        err = (a[k].double() - b[k].double()).abs().max() / b[k].double().abs().max().clamp(
            min=1e-12)
        assert err <= tol, (k, float(err))


def formula(kind: str, s: int, n: int, w: int, d: int, lr: float, lo: float) -> float:
    if s <= w:
        return lr * s / w
    p = (s - w) / (n - w)
    if kind == "constant":
        return lr
    if kind == "cosine":
        return lo + (lr - lo) * (1 + math.cos(math.pi * p)) / 2
    if kind == "linear":
        return lr - (lr - lo) * p
    return lr if s <= n - d else lo + (lr - lo) * (n - s) / d


@pytest.mark.parametrize("kind", ["constant", "cosine", "linear", "wsd"])
def test_schedule_formulas(kind):
    sched = Schedule(lr=1e-3, min_lr=1e-4, steps=20, warmup_steps=4, kind=kind, decay_steps=6)
    for s in range(1, 21):
        assert sched(s) == pytest.approx(formula(kind, s, 20, 4, 6, 1e-3, 1e-4), rel=1e-12)


@pytest.mark.slow
def test_logged_learning_rates_follow_the_schedule(tmp_path):
    for kind in ("constant", "cosine", "linear", "wsd"):
        out = train_case(recipe(steps=6, warmup_steps=2, schedule=kind, decay_steps=2,
                                min_lr=3e-4, log_dir=str(tmp_path / kind)))
        rows = [json.loads(line) for line in (tmp_path / kind / "metrics.jsonl").open()]
        assert [r["step"] for r in rows] == list(range(1, 7))
        for r in rows:
            assert r["lr"] == pytest.approx(formula(kind, r["step"], 6, 2, 2, 3e-3, 3e-4))
        assert out["rows"] == rows
        assert {"loss", "grad_norm", "tokens", "tokens_per_s", "mfu", "skipped",
                "max_memory_bytes"} <= set(rows[0])
        # predicted tokens: a synthetic row of 16 tokens predicts 15
        assert rows[-1]["tokens"] == 6 * 8 * 15 and rows[0]["mfu"] is None  # CPU: no peak


def test_accumulation_equals_one_micro_batch():
    """fp64 masters: the two runs differ only in summation order, which AdamW's normalisation
    turns into lr-sized updates of near-zero gradients in fp32 (measured 1.9e-5 relative with
    one thread, under 1e-5 with two); in fp64 the same order noise is ~1e-16 per operation."""
    whole = train_case(recipe(micro_batch_size=8), fp64=True)
    parts = train_case(recipe(micro_batch_size=2), fp64=True)
    assert parts["losses"] == pytest.approx(whole["losses"], rel=1e-10)
    close(parts["params"], whole["params"], 1e-9)


def test_ac_full_and_selective_equal_none():
    none = train_case(recipe(steps=2))
    for mode in ("full", "selective"):
        got = train_case(recipe(steps=2, ac=mode))
        assert got["losses"] == pytest.approx(none["losses"], rel=1e-6)
        close(got["params"], none["params"], 1e-6)


@pytest.mark.slow
def test_bf16_trains_close_to_fp32_with_fp32_masters(tmp_path):
    fp32 = train_case(recipe(steps=20))
    bf16 = train_case(recipe(steps=20, precision="bf16", save=str(tmp_path / "run")))
    assert fp32["losses"][-1] < fp32["losses"][0]
    assert abs(bf16["losses"][-1] - fp32["losses"][-1]) <= 0.05 * fp32["losses"][-1]
    assert all(p.dtype == torch.float32 for p in bf16["params"].values())
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "out")]) == 0
    from tests.helpers import read_all

    assert {t.dtype for t in read_all(tmp_path / "out").values()} == {torch.float32}


def test_muon_trains():
    out = train_case(recipe(steps=10, optimizer="muon", lr=1e-2))
    assert out["losses"][-1] < out["losses"][0] - 0.1


def test_clipping_bounds_the_update():
    clipped = train_case(recipe(steps=1, grad_clip=1e-3, lr=1.0, warmup_steps=0,
                                optimizer="adamw", weight_decay=0.0, adam_beta1=0.0))
    assert clipped["rows"][0]["grad_norm"] > 1e-3  # logged before clipping


@pytest.mark.slow
def test_exact_resume(tmp_path):
    straight = train_case(recipe(steps=6, save=str(tmp_path / "a")))
    first = train_case(recipe(steps=6, exit_at_step=3, save=str(tmp_path / "b")))
    assert (tmp_path / "b" / "latest").read_text().strip() == "step-00000003"
    rest = train_case({}, source=str(tmp_path / "b"))
    assert first["losses"] + rest["losses"] == straight["losses"]  # bit for bit
    for k, v in straight["params"].items():
        assert torch.equal(v, rest["params"][k]), k
    assert rest["step"] == 6


@pytest.mark.slow
def test_steps_extend_a_finished_run(tmp_path):
    train_case(recipe(steps=2, save=str(tmp_path / "r")))
    more = train_case({"steps": 4}, source=str(tmp_path / "r"))
    assert len(more["losses"]) == 2 and more["step"] == 4


@pytest.mark.slow
def test_keep_last(tmp_path):
    train_case(recipe(steps=5, save_every=1, keep_last=2, save=str(tmp_path / "r")))
    steps = sorted(p.name for p in (tmp_path / "r").iterdir() if p.name.startswith("step-"))
    assert steps == ["step-00000004", "step-00000005"]


@pytest.mark.slow
def test_async_save_resumes_like_sync(tmp_path):
    sync = train_case(recipe(steps=4, save_every=1, save=str(tmp_path / "s"), exit_at_step=2))
    asyn = train_case(recipe(steps=4, save_every=1, save=str(tmp_path / "a"), exit_at_step=2,
                             async_save=True))
    assert sync["losses"] == asyn["losses"]
    a = train_case({}, source=str(tmp_path / "a"))
    s = train_case({}, source=str(tmp_path / "s"))
    assert a["losses"] == s["losses"]
    for k, v in s["params"].items():
        assert torch.equal(v, a["params"][k]), k


def test_huge_lr_stops_with_exit_3_and_leaves_finite_checkpoints(tmp_path, capsys):
    run = tmp_path / "r"
    code = main(["train", "--config", "debug", "--steps", "30", "--lr", "1e30", "--save",
                 str(run), "--save-every", "1", "--json"])
    err = capsys.readouterr().err.strip()
    assert code == 3, err
    assert len(err.splitlines()) == 1 and "non-finite" in err, err
    assert (run / "latest").exists()
    assert main(["export", str(run), str(tmp_path / "out")]) == 0  # latest loads
    from tests.helpers import read_all

    for step in sorted(run.glob("step-*")):
        (run / "latest").write_text(step.name)
        out = tmp_path / f"out-{step.name}"
        assert main(["export", str(run), str(out)]) == 0
        assert all(torch.isfinite(t).all() for t in read_all(out).values()), step.name


@pytest.mark.slow
def test_debug_recipe_loss_falls(capsys):
    assert main(["train", "--config", "debug", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["steps"] == 40 and out["losses"][-1] < out["losses"][0] - 0.5
    assert {"steps", "loss", "tokens", "tokens_per_s", "wall_s"} <= set(out)


def test_weight_decay_skips_1d_parameters():
    from composer.train.optim import build_optimizers

    out = train_case(recipe(steps=0))
    from composer.build.builder import build_model
    from composer.train.engine import _model_config
    from composer.train.recipe import Recipe

    model = build_model(_model_config(Recipe(model=MODEL))[0], device="meta")
    opt = build_optimizers(model, "adamw", 1e-3, 0.1, (0.9, 0.95), 1e-8)
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for g in opt.param_groups if g["weight_decay"] for p in g["params"]}
    assert decayed and all(out["params"][n].ndim >= 2 for n in decayed)
    flat = {n for n, p in model.named_parameters() if p.ndim < 2}
    assert {"layers.0.mixer.A_log", "layers.0.mixer.D", "layers.0.mixer.dt_bias"} <= flat
    assert not flat & decayed


def test_muon_with_only_matrices_trainable_has_no_empty_adamw():
    """LoRA + Muon: every trainable parameter is a 2-D adapter matrix, so AdamW gets none (it
    used to be built anyway and refuse an empty parameter list); nothing trainable is an error."""
    from torch import nn

    from composer.train.optim import ShardedMuon, build_optimizers

    model = nn.Sequential(nn.Linear(8, 4, bias=False), nn.Linear(4, 8))
    model[1].bias.requires_grad_(False)
    opt = build_optimizers(model, "muon", 1e-2, 0.0, (0.9, 0.95), 1e-8)
    assert [type(o) for o in opt.opts] == [ShardedMuon]
    model(torch.randn(3, 8)).sum().backward()
    before = model[0].weight.detach().clone()
    opt.step()
    assert not torch.equal(model[0].weight, before)
    for q in model.parameters():
        q.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        build_optimizers(model, "adamw", 1e-2, 0.0, (0.9, 0.95), 1e-8)


def test_a_bf16_source_trains_with_fp32_masters(tmp_path):
    assert main(["build", "--preset", "llama-debug", "--out", str(tmp_path / "src")]) == 0
    assert main(["convert", "to-hf", str(tmp_path / "src"), str(tmp_path / "hf"),
                 "--dtype", "bfloat16"]) == 0
    assert main(["convert", "from-hf", str(tmp_path / "hf"), str(tmp_path / "bf16")]) == 0
    out = train_case({**BASE, "model": str(tmp_path / "bf16"), "steps": 1,
                      "save": str(tmp_path / "run")})
    assert {p.dtype for p in out["params"].values()} == {torch.float32}


def test_an_interrupted_save_is_cleaned_up_on_the_next_start(tmp_path):
    run = tmp_path / "run"
    train_case(recipe(steps=2, save=str(run)))
    (run / "step-00000007").mkdir()  # what a kill during a later save leaves
    (run / "step-00000007" / "__0_0.distcp").write_bytes(b"partial")
    more = train_case({"steps": 3}, source=str(run))
    assert more["step"] == 3 and not (run / "step-00000007").exists()
    assert (run / "latest").read_text().strip() == "step-00000003"


def test_bad_recipes_are_one_line_errors(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("steps: 2\nlearning_rate: 1e-3\n")
    assert main(["train", "llama-debug", "--config", str(bad)]) == 2
    assert "unknown recipe key 'learning_rate'" in capsys.readouterr().err
    assert main(["train", "llama-debug", "--config", "no-such-recipe", "--steps", "1"]) == 2
    assert "shipped: debug" in capsys.readouterr().err
    assert main(["train", "llama-debug", "--tokens", "synthetic", "--steps", "1",
                 "--precision", "fp8", "--device", "cpu"]) == 2
    assert "fp8 needs a CUDA device" in capsys.readouterr().err
    assert main(["train", "llama-debug", "--tokens", "synthetic", "--steps", "2",
                 "--global-batch-size", "6", "--micro-batch-size", "4"]) == 2
    assert "multiple of --micro-batch-size" in capsys.readouterr().err


def test_fp8_through_transformer_engine_on_the_cpu_is_one_line(capsys):
    assert main(["train", "--config", "debug", "--steps", "1", "--precision", "fp8",
                 "--fp8-backend", "te"]) == 2
    err = capsys.readouterr().err
    assert err == ("composer: error: --precision fp8 needs a CUDA device (transformer-engine "
                   "or torchao float8 training)\n")


def test_the_transformer_engine_module_imports_without_cuda():
    import importlib

    import torch

    fp8_te = importlib.import_module("composer.train.fp8_te")
    if not torch.cuda.is_available():  # a CPU-only TE raises at import: not available
        assert fp8_te.available() is False
    model = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.Linear(16, 10))
    # the selection needs no TE: widths that are multiples of 16 only
    assert [fp8_te._keep(n, m) for n, m in model.named_children()] == [True, False]


def test_config_then_flags_and_the_saved_recipe(tmp_path, capsys):
    assert main(["train", "--config", "debug", "--steps", "3", "--lr", "1e-3", "--save",
                 str(tmp_path / "r"), "--json"]) == 0
    import yaml

    saved = yaml.safe_load((tmp_path / "r" / "recipe.yaml").read_text())
    assert saved["steps"] == 3 and saved["lr"] == 1e-3 and saved["seq_len"] == 64
    assert saved["model"] == "nemotron-3-nano-debug"


TINY_LLAMA = ["llama-debug", "--set", "vocab_size=50", "--device", "cpu", "--precision", "fp32"]


def _byte_dataset(tmp_path) -> str:
    (tmp_path / "d.jsonl").write_text('{"text": "hello world"}\n{"text": "more text here"}\n')
    assert main(["data", "prepare", str(tmp_path / "d.jsonl"), "--out", str(tmp_path / "ds"),
                 "--tokenizer", "byte", "--json"]) == 0
    return str(tmp_path / "ds")


def test_a_run_failing_before_its_first_step_leaves_nothing_it_created(tmp_path, capsys):
    ds = _byte_dataset(tmp_path)  # bytes reach 120: past the vocabulary of 50
    keep = tmp_path / "keep"
    keep.mkdir()
    (keep / "mine.txt").write_text("the user's")
    for where in (["--log-dir", str(tmp_path / "out" / "run"), "--save",
                   str(tmp_path / "out2" / "run")], ["--save", str(keep)]):
        capsys.readouterr()
        assert main(["train", *TINY_LLAMA, "--data", ds, "--seq-len", "8", "--steps", "2",
                     *where]) == 2
        assert capsys.readouterr().err == (f"composer: error: {ds}: token id 120 (sample 0..) "
                                           "is beyond the model's vocabulary (50)\n")
    assert not (tmp_path / "out").exists() and not (tmp_path / "out2").exists()
    assert sorted(p.name for p in keep.iterdir()) == ["mine.txt"]


def test_a_save_folder_of_another_model_is_refused_and_the_same_one_resumes(tmp_path, capsys):
    run = tmp_path / "run"
    args = ["--tokens", "synthetic", "--seq-len", "8", "--global-batch-size", "2",
            "--save", str(run), "--json"]
    assert main(["train", *TINY_LLAMA, "--steps", "1", *args]) == 0
    capsys.readouterr()
    assert main(["train", "mamba2-debug", "--steps", "2", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"composer: error: {run} holds a run of a different model than "
                          "mamba2-debug (pattern '*-*-' there, 'MM' here; ")
    assert err.endswith(f"resume it with `composer train {run}`, or pick a new --save "
                        "folder\n") and len(err.splitlines()) == 1
    assert main(["train", str(run), "--steps", "2", "--set", "d_model=32", "--json"]) == 2
    assert capsys.readouterr().err == (
        f"composer: error: {run} holds a run of a different model than --set d_model=32 "
        f"(d_model 64 there, 32 here): resume it with `composer train {run}`, or pick a new "
        "--save folder\n")
    assert (run / "latest").read_text().strip() == "step-00000001"
    assert main(["train", *TINY_LLAMA, "--steps", "2", *args]) == 0  # the same model: resumes
    out, err = capsys.readouterr()
    assert json.loads(out)["step"] == 2
    assert err == f"composer train: resuming from step 1 ({run})\n"


def test_steps_0_of_a_recipe_with_validation_writes_the_initial_weights(tmp_path, capsys):
    run = tmp_path / "s0"
    assert main(["train", "--config", "shakespeare", "--steps", "0", "--save", str(run)]) == 0
    assert (run / "latest").read_text().strip() == "step-00000000"


def test_logged_tokens_are_predicted_tokens_and_2d_arrays_refuse_another_seq_len(tmp_path,
                                                                                 capsys):
    import numpy as np

    path = tmp_path / "rows.npy"
    np.save(path, np.arange(16 * 9).reshape(16, 9) % 50)
    base = ["train", *TINY_LLAMA, "--tokens", str(path), "--steps", "3", "--global-batch-size",
            "4", "--json"]
    for extra in ([], ["--seq-len", "8"], ["--seq-len", "9"]):
        assert main([*base, *extra]) == 0
        assert json.loads(capsys.readouterr().out)["tokens"] == 3 * 4 * 8  # rows of 9 predict 8
    assert main([*base, "--seq-len", "5"]) == 2
    assert capsys.readouterr().err == (
        f"composer: error: {path} is 2-D: its rows are the sequences (9 tokens, predicting 8); "
        "--seq-len 5 does not match them (drop it, or cut the array yourself)\n")
